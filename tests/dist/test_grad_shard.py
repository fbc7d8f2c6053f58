"""Stages 2 and 3 hold a step's gradient shard from its first reduced bucket piece to the end of the step only."""
import pytest
import torch

from ranks import run_ranks


def _shard_lifetime(rank, world, stage, micro_batches):
    """Which of the engine's per-step gradient shards exist at each moment of two steps, and their bytes while held."""
    import torch.distributed as dist
    import torch.nn as nn

    import zero3d
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    engine = zero3d.wrap_model(model, zero3d.EngineSettings(zero=zero3d.ZeroConfig(stage=stage, bucket_elements=200)),
                               zero3d.ParallelGroups(dp_group=None))
    groups = {name: g for name, g in engine.groups.items() if g.grads_per_step}
    held, held_bytes = {"built": sorted(n for n, g in groups.items() if g.grads is not None)}, 0
    data = torch.Generator().manual_seed(1 + rank)
    for step in range(2):
        for micro in range(micro_batches):
            x, y = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)
            out = engine(x)
            held[f"step {step}, forward {micro}"] = sorted(n for n, g in groups.items() if g.grads is not None)
            engine.backward((out - y).pow(2).mean() / micro_batches)
        engine.finish_param_sync()
        engine.buckets.wait()  # every reduced piece delivered: the shards as the step will hold them
        held_bytes = sum(g.grads.numel() * g.grads.element_size() for g in groups.values())
        engine.step(1e-2)
        held[f"after step {step}"] = sorted(n for n, g in groups.items() if g.grads is not None)
    return dict(held=held, groups=sorted(groups), held_bytes=held_bytes, counted=engine.state_bytes()["grads"])


@pytest.mark.parametrize("stage", [2, 3])
def test_a_steps_gradient_shard_lives_from_its_first_reduced_piece_to_the_step(stage):
    """Three ranks (buckets padded to a multiple of 3). No shard exists before a step's first forward ends or after its
    step; with two micro-batches every shard exists in the second forward (stage 2 delivers the first's reductions
    before it, so it sums into them). The accounting counts a shard's bytes as the step holds them."""
    for micro_batches in (1, 2):
        for out in run_ranks(_shard_lifetime, 3, stage, micro_batches, timeout=120):
            held, groups = out["held"], out["groups"]
            assert groups and held["built"] == [], held
            for step in range(2):
                assert held[f"step {step}, forward 0"] == [] and held[f"after step {step}"] == [], held
                if micro_batches == 2 and stage == 2:
                    assert held[f"step {step}, forward 1"] == groups, held
            assert out["counted"] == out["held_bytes"] > 0
