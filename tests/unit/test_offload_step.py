"""The host and NVMe optimizer steps against torch's AdamW, the NVMe buffer bound, the offload config checks."""
import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

from pretrain.config import ConfigError, load_config
from zero3d.nvme import NvmeOffload, buffer_bytes_per_element, chunk_elements
from optim.config import OptimizerConfig
from zero3d.config import ZeroConfig, ZeroConfigError
from zero3d.offload import Copier, GroupSpec, HostOffload
from optim import ADAMW
from optim.flat_optimizer import FlatOptimizer, FlatTensor

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)  # torch's AdamW: the reference
CONFIG = OptimizerConfig(lr=HYPER["lr"], beta2=0.95, eps=1e-8)  # the same, as the engine's [optimizer]
SIZES = {"decay": 10_000, "no_decay": 333}


def make_specs(dtype=torch.float32, pieces=1):
    """Two groups; each group's device parameters in `pieces` separate tensors (stages 1/2 at DP > 1
    hold one piece per bucket)."""
    g = torch.Generator().manual_seed(0)
    specs = []
    for name, n in SIZES.items():
        bounds = [n * i // pieces for i in range(pieces + 1)]
        param_pieces = tuple((lo, torch.zeros(hi - lo, dtype=dtype)) for lo, hi in zip(bounds, bounds[1:]))
        specs.append(GroupSpec(name, torch.randn(n, generator=g), param_pieces, 0.1 if name == "decay" else 0.0))
    return specs


def device_params(spec):
    return torch.cat([piece for _, piece in spec.param_pieces])


def grads_at(step):
    g = torch.Generator().manual_seed(100 + step)
    return {name: torch.randn(n, generator=g) for name, n in SIZES.items()}


def reference(specs, steps, coef):
    """torch.optim.AdamW(fused=True) on whole tensors, the engine's clip multiplication first."""
    masters = {s.name: s.master.clone() for s in specs}
    opt = torch.optim.AdamW([{"params": [masters[s.name]], "weight_decay": s.weight_decay} for s in specs],
                            fused=True, **HYPER)
    for step in range(steps):
        for name, grad in grads_at(step).items():
            masters[name].grad = grad.mul_(coef)
        opt.step()
    return masters, opt


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
def test_offloaded_step_is_torch_adamw_bit_for_bit(placement, tmp_path):
    specs = make_specs(pieces=3)
    ref, ref_opt = reference(specs, steps=3, coef=0.5)
    off = (HostOffload(specs, CONFIG, Copier(torch.device("cpu"))) if placement == "cpu" else
           NvmeOffload(specs, CONFIG, Copier(torch.device("cpu")), nvme_path=str(tmp_path), buffer_bytes=2 * 16 * 4096,
                       rank=0))
    if placement == "nvme":
        assert off.chunk == 4096  # 10_000 elements: three chunks through two buffers
    for step in range(3):
        off.step(grads_at(step), coef=0.5, lr=HYPER["lr"])
        off.zero_grad()
    for s in specs:
        assert torch.equal(device_params(s), ref[s.name])  # published into the "device" pieces
    with off.materialized():
        for i, s in enumerate(specs):
            master = off.master(s.name)
            assert torch.equal(master, ref[s.name])
            state, ref_state = off.optimizer.state[master], ref_opt.state[ref_opt.param_groups[i]["params"][0]]
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(state[key], ref_state[key]), key
    if placement == "nvme":
        assert off.master("decay").numel() == 0  # released again outside materialized()
        off.close()


def test_held_fp16_gradients_accumulate_on_the_host():
    """Stages 2/3 with the optimizer on the host: each reduced fp16 bucket piece is copied down and
    added (× post-scale) into the host fp32 shard, over micro-batches; the engine then unscales that
    shard in place and the step uses it. Same arithmetic as the device path's shard, in fp32."""
    specs = [dataclasses.replace(spec, holds_grad=True) for spec in make_specs(torch.float16)]
    off = HostOffload(specs, CONFIG, Copier(torch.device("cpu")))
    scale, post_scale, micro_batches = 1024.0, 0.5, 2
    raw = [{name: (g * 1e-3 * scale).half() for name, g in grads_at(m).items()} for m in range(micro_batches)]
    before = dict(off.copier.bytes)
    for pieces in raw:
        for name, grad in pieces.items():  # in two pieces, as two buckets would land
            group = SimpleNamespace(name=name)  # the engine's GroupState: the placement reads its name
            off.accumulate_grad(group, 0, grad[:100], post_scale)
            off.accumulate_grad(group, 100, grad[100:], post_scale)
    off.finish_grads()
    for spec in specs:
        off.grad(spec.name).mul_(1.0 / scale)  # the engine's unscale
    off.step({}, coef=1.0, lr=HYPER["lr"])
    # The PCIe traffic: each micro-batch's fp16 gradient shard down, the fp16 parameters up once.
    n = sum(SIZES.values())
    assert {k: off.copier.bytes[k] - before[k] for k in before} == {"to_host": micro_batches * 2 * n, "to_device": 2 * n}
    masters = {s.name: s.master.clone() for s in specs}
    opt = torch.optim.AdamW([{"params": [masters[s.name]], "weight_decay": s.weight_decay} for s in specs],
                            fused=True, **HYPER)
    for name in masters:
        grad = torch.zeros(SIZES[name])
        for pieces in raw:
            grad.add_(pieces[name], alpha=post_scale)
        masters[name].grad = grad.mul_(1.0 / scale)
    opt.step()
    for s in specs:
        assert torch.equal(off.master(s.name), masters[s.name])
        assert torch.equal(device_params(s), masters[s.name].half())  # back in the compute dtype
    assert off.held_grad_bytes() == 4 * n


def test_nvme_materialized_writes_back_what_a_load_put_there(tmp_path):
    specs = make_specs()
    off = NvmeOffload(specs, CONFIG, Copier(torch.device("cpu")), nvme_path=str(tmp_path), buffer_bytes=1 << 20,
                      rank=0)
    with off.materialized():
        assert len(off.optimizer.state) == 0  # before the first step, as torch's AdamW
        master = off.master("decay")
        master.data.fill_(3.0)
        off.optimizer.state[master] = {"step": torch.tensor(7.0), "exp_avg": torch.full_like(master, 1.0),
                                       "exp_avg_sq": torch.full_like(master, 2.0)}
    with off.materialized():
        master = off.master("decay")
        assert torch.equal(master, torch.full((SIZES["decay"],), 3.0))
        assert float(off.optimizer.state[master]["step"]) == 7.0
        assert torch.equal(off.optimizer.state[master]["exp_avg_sq"], torch.full_like(master, 2.0))
    assert list(tmp_path.iterdir()) == []  # the files are unlinked while open
    off.close()


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
def test_offloaded_bf16_states_step_as_the_device_optimizer(placement, tmp_path):
    """optimizer.state_dtype = "bf16" off the device: the host and NVMe steps give the device optimizer's masters and
    bf16 states bit for bit (the same fp32 update, the same rounding), the NVMe files hold 2 bytes a state element,
    and its buffers fit twice the chunk: 4 + 2 × 2 + 4 bytes an element (master, moments, gradient)."""
    config = dataclasses.replace(CONFIG, state_dtype="bf16")
    specs = make_specs(pieces=3)
    masters = [s.master.clone() for s in specs]
    device = FlatOptimizer([FlatTensor(m, s.weight_decay) for m, s in zip(masters, specs)], ADAMW, config, fused=True)
    off = (HostOffload(specs, config, Copier(torch.device("cpu"))) if placement == "cpu" else
           NvmeOffload(specs, config, Copier(torch.device("cpu")), nvme_path=str(tmp_path), buffer_bytes=2 * 12 * 4096,
                       rank=0))
    if placement == "nvme":
        assert buffer_bytes_per_element(torch.float32, ADAMW, "bf16") == 12 and off.chunk == 4096
        assert off.off_device_bytes()["nvme_optimizer_states"] == 4 * sum(SIZES.values())
    for step in range(3):
        for m, g in zip(masters, grads_at(step).values()):
            m.grad = g.clone()
        device.step()
        off.step(grads_at(step), coef=1.0, lr=HYPER["lr"])
        off.zero_grad()
    with off.materialized():
        for m, s in zip(masters, specs):
            master = off.master(s.name)
            assert torch.equal(master, m) and torch.equal(device_params(s), m)
            for key in ("exp_avg", "exp_avg_sq"):
                state = off.optimizer.state[master][key]
                assert state.dtype == torch.bfloat16 and torch.equal(state, device.state[m][key])
    if placement == "nvme":
        off.close()


def test_nvme_buffers_stay_within_the_budget():
    for dtype in (torch.float32, torch.bfloat16):
        per = buffer_bytes_per_element(dtype)
        budget = 10 * 2**20 + 123
        chunk = chunk_elements(budget, dtype, largest_group=10**9)
        assert chunk % 4096 == 0 and 2 * chunk * per <= budget < 2 * (chunk + 4096) * per
    assert chunk_elements(1 << 30, torch.float32, largest_group=5000) == 8192  # never above the largest group
    with pytest.raises(ValueError, match=re.escape("zero.nvme_buffer_bytes = 1000 is too small: two buffers of "
                                                   "4096 elements × 16 bytes need at least 131072")):
        chunk_elements(1000, torch.float32, largest_group=10**6)


def test_state_bytes_move_to_host_keys():
    off = HostOffload(make_specs(torch.bfloat16), CONFIG, Copier(torch.device("cpu")))
    stage = {"params": 10, "grads": 5, "master_params": 40, "optimizer_states": 80,
             "persistent_master_params": 4, "persistent_optimizer_states": 8}
    n = sum(SIZES.values())
    assert off.state_bytes(stage) == {
        "params": 10, "grads": 5, "master_params": 0, "optimizer_states": 0, "persistent_master_params": 0,
        "persistent_optimizer_states": 0, "host_master_params": 4 * n, "host_optimizer_states": 0,
        "host_grads": 4 * n + 2 * n}  # Adam's moments exist from the first step on


@pytest.mark.parametrize("overrides,message", [
    (["zero.offload_optimizer=\"cpu\""], "zero.offload_optimizer = 'cpu' needs zero.stage >= 1"),
    (["zero.stage=2", "zero.offload_optimizer=\"cpu\"", "zero.offload_params=\"cpu\""],
     "zero.offload_params = 'cpu' needs zero.stage = 3"),
    (["zero.stage=3", "zero.offload_params=\"cpu\""], "zero.offload_params = 'cpu' needs zero.offload_optimizer"),
    (["zero.stage=1", "zero.offload_optimizer=\"nvme\""], "needs zero.nvme_path"),
    (["zero.stage=1", "zero.offload_optimizer=\"disk\""],
     "zero.offload_optimizer = 'disk' is invalid; valid values: 'none', 'cpu', 'nvme'"),
    (["zero.stage=1", "zero.offload_optimizer=\"nvme\"", "zero.nvme_path=\"/nonexistent/zero3d\""],
     "zero.nvme_path = '/nonexistent/zero3d' is not a writable directory"),
    (["zero.stage=1", "zero.nvme_buffer_bytes=0"], "zero.nvme_buffer_bytes = 0 must be > 0"),
])
def test_offload_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, overrides)


def test_engine_config_refuses_the_same():
    """zero3d's own dataclass checks itself (the engine is used without pretrain's config too)."""
    with pytest.raises(ZeroConfigError, match="zero.offload_optimizer = 'cpu' needs zero.stage >= 1"):
        ZeroConfig(offload_optimizer="cpu")
    ZeroConfig(stage=1, offload_optimizer="nvme", nvme_path="/tmp")


def test_train_passes_the_offload_keys_to_the_engine(tmp_path):
    from pretrain.train import engine_settings

    cfg = load_config(None, ["zero.stage=3", "zero.offload_optimizer=\"nvme\"", "zero.offload_params=\"cpu\"",
                             f"zero.nvme_path=\"{tmp_path}\"", "zero.nvme_buffer_bytes=1048576"])
    zero = engine_settings(cfg).zero
    assert (zero.offload_optimizer, zero.offload_params, zero.nvme_path, zero.nvme_buffer_bytes) == (
        "nvme", "cpu", str(tmp_path), 1048576)


def test_file_backed_parameter_shard(tmp_path):
    from zero3d.nvme import file_backed_copy

    shard = torch.randn(1000).to(torch.bfloat16)
    mapped = file_backed_copy(shard, str(tmp_path), rank=0)
    assert torch.equal(mapped, shard) and mapped.dtype == torch.bfloat16
    mapped.add_(1)  # written through the mapping; the file itself is already unlinked
    assert torch.equal(mapped, shard + 1) and list(tmp_path.iterdir()) == []
