"""Where a mixed-precision step keeps the fp32 gradient it updates from: nowhere whole. The device placement casts the
compute-dtype shard a STEP_CHUNK at a time into its update (optim/flat_optimizer.py), "cpu" copies the pieces down into
its host shard, NVMe casts the shard a chunk at a time on its way to the host: no fp32 tensor larger than one chunk is
allocated during the step (the estimator's `step_bytes`: analysis/step_moment.py)."""
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

    import optim.flat_optimizer
    zero3d.engine.NORM_BLOCK = zero3d.engine.STEP_CHUNK = optim.flat_optimizer.STEP_CHUNK = 64  # casts: 64 elements
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
def test_no_placement_makes_an_fp32_gradient_copy_for_its_step(stage, tmp_path):
    """Three ranks, bf16, the step's casts at 64 elements: no placement allocates an fp32 tensor larger than 64
    elements in its step, though the groups' shards here are up to 1,793 elements (before, the device placement cast
    each whole shard to fp32 for its update)."""
    found = {}
    for placement in ("none", "cpu", "nvme"):
        nvme_dir = tmp_path / placement
        nvme_dir.mkdir()
        found[placement] = run_ranks(_fp32_allocations_in_step, 3, stage, placement, nvme_dir, timeout=180)
    for rank in range(3):
        assert max(found["none"][rank]["shards"].values()) > 8 * 64
        for placement in ("none", "cpu", "nvme"):
            made = found[placement][rank]["made"]
            assert made and max(made) <= 64, (placement, sorted(made)[-4:])
