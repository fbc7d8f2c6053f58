"""Planner offload tiers: none while a layout fits on the device; else optimizer→cpu, →nvme, then stage 3 params."""
import pytest

from analysis import planner
from analysis.estimate import GIB, Parallelism, ZeroChoice, estimate_from_shape, gpt_param_count, paper_shape
from analysis.offload_estimate import offload_breakdown

CLUSTER = planner.PAPER_CLUSTER
NODE_HOST = 0.9 * 24 * 64 * GIB  # paper §4.1: 24 × 64 GB DIMMs per DGX-2, less the 10% margin
NODE_NVME = 0.9 * 2 * 960e9  # 2 × 960 GB NVMe SSDs


def test_a_shape_that_fits_on_the_device_gets_no_offload_layout():
    """1.3B (24 × 2048) on 16 GPUs, global batch 16: stage 0 fits, so no offload is proposed, though an
    offloaded layout would fit too."""
    found = planner.plan(layers=24, hidden=2048, heads=16, gpus=16, global_batch=16)
    assert found and all(c.offload is None and not c.zero.offloaded and c.pcie_s == 0 for c in found)
    shape = dict(model=paper_shape(2048, 24, 16, 50257, 1024), gpus=16, recompute="full", precision="fp16")
    offloaded = planner._candidate(CLUSTER, shape, 1, planner.ZeroChoice(2, offload_optimizer="cpu"), 1, 16,
                                   50_000_000, 0.1)
    assert offloaded is not None and offloaded.offload.host_bytes > 0


def test_a_shape_that_fits_only_with_the_optimizer_on_the_host():
    """6.5B (30 × 4096) on one GPU, global batch 8: 16Ψ = 103 GB does not fit 32 GiB at any stage; with the
    fp32 master and moments on the host the device keeps 2Ψ parameters (+ 2Ψ gradients at stage 1; at
    stages 2-3 the gradient shard is on the host too) and fits."""
    kwargs = dict(layers=30, hidden=4096, heads=32, gpus=1, global_batch=8)
    assert planner.plan(**kwargs, offload=False) == []
    found = planner.plan(**kwargs)
    assert {c.zero.stage for c in found} == {1, 2, 3}
    psi = gpt_param_count(30, 4096, 50257, 1024)
    for c in found:
        assert (c.zero.offload_optimizer, c.zero.offload_params) == ("cpu", "none") and c.memory.fits
        assert c.memory.optimizer_bytes == 0 and c.memory.param_bytes == 2 * psi
        assert c.memory.grad_bytes == (2 * psi if c.zero.stage == 1 else 0)
        assert "opt→cpu" in c.zero.label
        # N_d = 1: master 4 + moments 8 + fp32 gradient 4 + its fp16 landing copy 2 bytes per parameter
        assert c.offload.host_bytes == pytest.approx(18 * psi)
        down = 4 * psi if c.zero.stage == 1 else 2 * psi * c.accumulation  # stage 1: fp32 at the step
        assert c.offload.pcie_bytes_per_step == pytest.approx(down + 2 * psi)
        assert c.pcie_s == pytest.approx(c.offload.pcie_bytes_per_step / CLUSTER.pcie_bandwidth)
    best = found[0]
    assert "host 116.2 GB" in planner.format_candidates([best]) and best.samples_per_s >= found[-1].samples_per_s


def test_host_memory_short_moves_the_optimizer_to_nvme():
    """89B (110 × 8192) on one node: stage 3 + optimizer on the host fits the device, but 16 GPUs × 18Ψ/16
    of host states exceed the node's 1.5 TB; in files (12Ψ) they fit its NVMe."""
    psi = gpt_param_count(110, 8192, 50257, 1024)
    assert 18 * psi > NODE_HOST and 12 * psi < NODE_NVME
    device = estimate_from_shape(layers=110, hidden=8192, heads=64, vocab=50257, seq=1024, gpus=16, stage=3,
                                 recompute="full", bucket_elements=50_000_000)
    on_host = offload_breakdown(device, Parallelism(16), ZeroChoice(3, offload_optimizer="cpu"))
    assert on_host.fits and not device.fits
    found = planner.plan(layers=110, hidden=8192, heads=64, gpus=16, global_batch=16)
    assert found and all((c.zero.offload_optimizer, c.zero.offload_params) == ("nvme", "none") for c in found)
    assert all(c.offload.host == {"buffers": 64 * 2**20} for c in found if not c.zero.pa_cpu)


def test_parameters_are_offloaded_last():
    """138B (170 × 8192) on one node: only stage 3 with the optimizer in files and the parameter shards on the
    host fits (the host holds 2Ψ/16 per GPU; the device keeps gradients, activations and buffers)."""
    found = planner.plan(layers=170, hidden=8192, heads=64, gpus=16, global_batch=16)
    assert found and {(c.zero.stage, c.zero.offload_optimizer, c.zero.offload_params) for c in found} == {
        (3, "nvme", "cpu")}
    for c in found:
        shard = c.memory.params_per_rank / c.dp
        assert c.memory.param_bytes == 0 and c.offload.host["params"] == pytest.approx(2 * shard)
        assert CLUSTER.holds_offload(c.offload, 16, 0.1)
