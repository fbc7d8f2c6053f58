"""Where a mixed-precision step keeps the fp32 gradient it updates from: the device placement makes an fp32 copy of
each group's gradient shard for it (the estimator's `step_bytes`, 4Ψ/N_d); ZeRO-Offload's placements make none on the
device ("cpu" copies the pieces down into its host shard, NVMe casts the shard a chunk at a time), so no fp32 tensor as
large as a shard is allocated during their step."""
import pytest
import torch

from ranks import run_ranks


def _fp32_allocations_in_step(rank, world, stage, placement, nvme_dir):
    """The fp32 tensors allocated during the second of two steps (sizes in elements), and each group's shard size."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    import zero3d
    import zero3d.engine

    class NewStorages(TorchDispatchMode):
        """Records the dtype and elements of every op output whose storage no input had: an allocation."""

        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            inputs = [t.untyped_storage() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and not any(t.untyped_storage() is s for s in inputs):
                    self.made.append((t.dtype, t.untyped_storage().nbytes() // t.element_size()))
            return out

    zero3d.engine.NORM_BLOCK = 64  # the norm's casts of compute-dtype blocks: 8 × 64 elements at a time
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    model = model.to(torch.bfloat16)
    nvme = {"nvme_path": str(nvme_dir), "nvme_buffer_bytes": 300_000} if placement == "nvme" else {}
    zero = zero3d.ZeroConfig(stage=stage, bucket_elements=1000, offload_optimizer=placement, **nvme)
    engine = zero3d.wrap_model(model, zero3d.EngineSettings(zero=zero, dtype=torch.bfloat16),
                               zero3d.ParallelGroups(dp_group=None))
    data = torch.Generator().manual_seed(1 + rank)
    for step in range(2):
        x, y = torch.randn(4, 16, generator=data), torch.randn(4, 4, generator=data)
        engine.backward((engine(x.bfloat16()).float() - y).pow(2).mean())
        if step == 0:
            engine.step(1e-2)
            continue
        with NewStorages() as mode:
            engine.step(1e-2)
    shards = {name: g.layout.shard_numel for name, g in engine.groups.items()}
    engine.close()
    return dict(made=[n for dtype, n in mode.made if dtype == torch.float32], shards=shards)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_only_the_device_placement_makes_an_fp32_gradient_copy_for_its_step(stage, tmp_path):
    """Three ranks, bf16, the norm's blocks at 64 elements. The device placement allocates an fp32 tensor of exactly
    each group's shard size; "cpu" and (stages 2/3, whose shard is one piece) NVMe allocate no fp32 tensor larger than
    one norm block (NVMe's cast blocks; the groups' shards here are up to 1,793 elements)."""
    found = {}
    for placement in ("none", "cpu", "nvme"):
        nvme_dir = tmp_path / placement
        nvme_dir.mkdir()
        found[placement] = run_ranks(_fp32_allocations_in_step, 3, stage, placement, nvme_dir, timeout=180)
    for rank in range(3):
        shards = found["none"][rank]["shards"]
        assert max(shards.values()) > 8 * 64  # larger than the norm's casts of 8 blocks at once
        assert all(n in found["none"][rank]["made"] for n in shards.values() if n > 64), found["none"][rank]
        assert max(found["cpu"][rank]["made"], default=0) <= 64, found["cpu"][rank]
        if stage >= 2:
            assert max(found["nvme"][rank]["made"], default=0) <= 64, found["nvme"][rank]
