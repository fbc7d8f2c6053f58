"""ZeRO-Offload (optimizer states on the host or in files) against the same run without offload."""
import pytest
import torch

from checkpoint_harness import train_segment
from gpt_harness import REFERENCE_STEPS, run_gpt_steps
from ranks import run_ranks

STEPS = REFERENCE_STEPS  # the device references are test_zero.py's and test_stage3.py's runs


def run(tp, stage, extra=(), steps=STEPS, inject_inf_at=None):
    overrides = [f"parallel.tensor={tp}", f"zero.stage={stage}", "train.global_batch_size=8", *extra]
    return run_ranks(run_gpt_steps, tp * 2, overrides, steps, inject_inf_at, timeout=300)


def offload(placement, tmp_path, key="offload_optimizer"):
    out = [f"zero.{key}=\"{placement}\""]
    if placement == "nvme":  # a small budget, so every group streams through several chunks
        out += [f"zero.nvme_path=\"{tmp_path}\"", "zero.nvme_buffer_bytes=300000"]
    return out


def assert_same_training(ref, out, rtol=1e-6, param_atol=1e-5):
    """Losses and gradient norms within rtol; parameters within param_atol: the host step is torch's
    fused CPU AdamW, the device path's CPU AdamW the single-tensor one — they round apart by an ulp."""
    for r_ref, r_out in zip(ref, out):
        torch.testing.assert_close(torch.tensor(r_out["loss"]), torch.tensor(r_ref["loss"]), rtol=rtol, atol=0)
        torch.testing.assert_close(torch.tensor(r_out["grad_norm"]), torch.tensor(r_ref["grad_norm"]),
                                   rtol=rtol, atol=0)
        assert r_out["skipped"] == r_ref["skipped"]
        assert r_out["params"].keys() == r_ref["params"].keys()
        for name, p in r_ref["params"].items():
            torch.testing.assert_close(r_out["params"][name], p, rtol=rtol, atol=param_atol, msg=name)


# TP 2 where the host holds the gradient shard (stages 2 and 3); stage 1's host step is stage 2's without it
@pytest.mark.parametrize("stage,tp", [(1, 1), (2, 1), (3, 1), (2, 2), (3, 2)])
def test_offload_matches_device_fp32(tp, stage, tmp_path, gpt_run):
    # the device reference through the dist tier's cache: test_zero.py trains the same stage 1-2 runs
    ref = gpt_run(tp * 2, [f"parallel.tensor={tp}", f"zero.stage={stage}", "train.global_batch_size=8"], STEPS)
    assert ref[0]["loss"][-1] < ref[0]["loss"][0]  # it trains
    cpu = gpt_run(tp * 2, [f"parallel.tensor={tp}", f"zero.stage={stage}", "train.global_batch_size=8",
                           *offload("cpu", tmp_path)], STEPS)  # cached: test_stage3_param_offload_matches's too
    nvme = run(tp, stage, offload("nvme", tmp_path))
    assert_same_training(ref, cpu)
    assert_same_training(ref, nvme)
    # Both run the same fused AdamW, NVMe in 4096-aligned chunks: bit for bit the same training.
    assert_same_training(cpu, nvme, rtol=0, param_atol=0)
    for r_ref, r_cpu, r_nvme in zip(ref, cpu, nvme):
        moved = r_ref["state_bytes"]["optimizer_states"]
        assert moved > 0
        assert r_cpu["state_bytes"]["master_params"] == r_cpu["state_bytes"]["optimizer_states"] == 0
        assert r_nvme["state_bytes"]["master_params"] == r_nvme["state_bytes"]["optimizer_states"] == 0
        assert r_cpu["state_bytes"]["host_optimizer_states"] == moved == r_nvme["state_bytes"]["nvme_optimizer_states"]
        # "cpu" at stages 2/3 keeps the gradient shard on the host only (ZeRO-Offload); stage 1's whole
        # gradient buffer, and NVMe's shard, stay on the device.
        held = stage >= 2
        assert r_cpu["state_bytes"]["grads"] == (0 if held else r_ref["state_bytes"]["grads"])
        assert r_nvme["state_bytes"]["grads"] == r_ref["state_bytes"]["grads"]
        assert r_nvme["state_bytes"]["host_buffers"] <= 300000
    assert list(tmp_path.iterdir()) == []  # the state files are removed with the engine


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_overflow_skips_the_same_steps(stage, tmp_path):
    """An inf on one rank skips the step everywhere, with or without offload; the loss scale follows
    the same path; a small clip threshold makes every update a clipped one (norm × coef on the host)."""
    extra = ["precision.dtype=\"fp16\"", "precision.hysteresis=1", "precision.initial_loss_scale=1024",
             "optimizer.clip_grad=0.05"]
    inject = (1, 1)  # step 1, rank 1 only
    ref = run(1, stage, extra, steps=5, inject_inf_at=inject)
    assert ref[0]["skipped"] == [False, True, False, False, False]
    assert all(n > 0.05 for n, skipped in zip(ref[0]["grad_norm"], ref[0]["skipped"]) if not skipped)
    for placement in ("cpu", "nvme") if stage == 3 else ("cpu",):  # one host step for both: NVMe streams it
        out = run(1, stage, extra + offload(placement, tmp_path), steps=5, inject_inf_at=inject)
        for r_ref, r_out in zip(ref, out):
            assert r_out["skipped"] == r_ref["skipped"]
            assert r_out["loss_scale"] == r_ref["loss_scale"]
            assert r_out["param_checksum"][1] == r_out["param_checksum"][0]  # the skip left them alone
            # fp16 parameters: an ulp of the fp32 master apart can round to neighbouring fp16 values.
            torch.testing.assert_close(torch.tensor(r_out["loss"]), torch.tensor(r_ref["loss"]),
                                       rtol=1e-3, atol=0)
            # The clipped updates themselves: Adam moves an element by about lr a step, and the two paths
            # agree to rounding (fused vs single-tensor AdamW, fp16 parameters): within lr/4 after the 4
            # updates. Unclipped updates (clip 0.05 vs a norm ~1) land up to 1.3e-3 away.
            for name, p in r_ref["params"].items():
                torch.testing.assert_close(r_out["params"][name], p, rtol=0, atol=1e-3 / 4, msg=name)


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_resumes_across_offload_settings(stage, tmp_path):
    """A DCP checkpoint holds the same master, Adam moments and step count whatever the placement:
    saved with one, resumed with another (on, off, nvme), the run continues as the uninterrupted one."""
    overrides = [f"zero.stage={stage}", "train.global_batch_size=8"]
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    placements = {"none": [], "cpu": offload("cpu", nvme_dir), "nvme": offload("nvme", nvme_dir)}
    straight = run_ranks(train_segment, 2, overrides, tmp_path / "straight", 0, 6, timeout=300)
    for first, second in (("cpu", "none"), ("none", "nvme"), ("nvme", "cpu")):
        save_dir = tmp_path / f"{first}-{second}"
        run_ranks(train_segment, 2, overrides + placements[first], save_dir, 0, 3, (3,), timeout=300)
        resumed = run_ranks(train_segment, 2, overrides + placements[second], save_dir, 3, 6, (), True, timeout=300)
        assert resumed[0]["resumed"]["step"] == 3
        torch.testing.assert_close(torch.tensor(resumed[0]["loss"]), torch.tensor(straight[0]["loss"][3:]),
                                   rtol=1e-6, atol=0, msg=f"{first} -> {second}")
    assert list(nvme_dir.iterdir()) == []


@pytest.mark.parametrize("tp", [1, 2])
def test_stage3_param_offload_matches(tp, tmp_path, gpt_run):
    """offload_params = cpu / nvme: the parameter shards live in host memory / in memory-mapped files
    and every gather fetches them; the same training as without offload, and bit for bit the run
    with only the optimizer offloaded."""
    # the reference and the optimizer-only run: test_offload_matches_device_fp32's, through the dist tier's cache
    ref = gpt_run(tp * 2, [f"parallel.tensor={tp}", "zero.stage=3", "train.global_batch_size=8"], STEPS)
    opt_only = gpt_run(tp * 2, [f"parallel.tensor={tp}", "zero.stage=3", "train.global_batch_size=8",
                                *offload("cpu", tmp_path)], STEPS)
    assert_same_training(ref, opt_only)
    for placement in ("cpu", "nvme"):
        params = run(tp, 3, offload("cpu", tmp_path) + offload(placement, tmp_path, key="offload_params"))
        assert_same_training(opt_only, params, rtol=0, param_atol=0)
        for r, r_opt in zip(params, opt_only):
            moved = r["state_bytes"]
            assert moved["params"] == 0
            assert moved[f"{'host' if placement == 'cpu' else 'nvme'}_params"] == r_opt["state_bytes"]["params"] > 0
    assert list(tmp_path.iterdir()) == []  # the mapped files are unlinked


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nvme_unscales_the_fp16_gradient_shard_it_reads(stage, tmp_path):
    """fp16 at loss scale 1024 with SGD (its update is the gradient's own size, where Adam's would hide a scale): NVMe's
    step reads the fp16 shard itself (stage 1's pieces joined in fp16), no fp32 copy of it on the device, and
    unscales it a chunk at a time on the host (its norm a few blocks at a time on the device); it trains as the device
    placement, whose step unscales each chunk as it casts it into its update."""
    extra = ['precision.dtype="fp16"', "precision.initial_loss_scale=1024", 'optimizer.name="sgd"']
    ref = run(1, stage, extra, steps=4)
    out = run(1, stage, extra + offload("nvme", tmp_path), steps=4)
    assert not any(ref[0]["skipped"]) and ref[0]["loss_scale"][0] == 1024
    for r_ref, r_out in zip(ref, out):
        torch.testing.assert_close(torch.tensor(r_out["grad_norm"]), torch.tensor(r_ref["grad_norm"]), rtol=1e-6,
                                   atol=0)
        torch.testing.assert_close(torch.tensor(r_out["loss"]), torch.tensor(r_ref["loss"]), rtol=1e-3, atol=0)
        for name, p in r_ref["params"].items():
            torch.testing.assert_close(r_out["params"][name], p, rtol=0, atol=1e-3, msg=name)
