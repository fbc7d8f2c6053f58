"""Overlap: stage 1/2 parameter all-gathers stay in flight after step() until the module using
them runs; the debug settings turn each overlap off without changing the result."""
import pytest
import torch

from ranks import run_ranks


def _train(rank, world, stage, overlap):
    import torch.distributed as dist
    import torch.nn as nn

    import zero3d
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    zero = zero3d.ZeroConfig(stage=stage, bucket_elements=200, overlap_comm=overlap, overlap_param_gather=overlap)
    engine = zero3d.wrap_model(model, zero3d.EngineSettings(zero=zero, optimizer=zero3d.OptimizerConfig(clip_grad=1.0)),
                               zero3d.ParallelGroups(dp_group=None))
    data = torch.Generator().manual_seed(1 + rank)
    pending, hidden, norms = [], [], []
    for _ in range(3):
        engine.comm_stats.reset()
        x, y = torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)
        engine.backward((engine(x) - y).pow(2).mean())
        norms.append(engine.step(1e-2).grad_norm)
        pending.append(len(engine.pending_param_gathers))
        hidden.append(engine.comm_stats.hidden_fraction())
    first_layer_waited = None
    if stage in (1, 2) and overlap:  # the first layer's forward waits for its bucket only
        model[0](torch.zeros(1, 8))
        first_layer_waited = len(engine.pending_param_gathers) < pending[-1]
    model.state_dict()  # waits for the gathers still in flight
    in_flight_after_state_dict = len(engine.pending_param_gathers)
    params = engine.gathered_parameters() if stage == 3 else dict(model.named_parameters())
    buckets = sum(len(group.buckets) for group in engine.groups.values())
    return dict(norms=norms, pending=pending, hidden=hidden, buckets=buckets, first_layer_waited=first_layer_waited,
                in_flight_after_state_dict=in_flight_after_state_dict, params={name: p.detach().clone() for name, p in params.items()})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overlap_off_gives_the_same_training(stage):
    ref = run_ranks(_train, 2, 0, True)
    for overlap in (True, False):
        for r_ref, r_out in zip(ref, run_ranks(_train, 2, stage, overlap)):
            torch.testing.assert_close(torch.tensor(r_out["norms"]), torch.tensor(r_ref["norms"]), rtol=1e-5, atol=0)
            for name, p in r_ref["params"].items():
                torch.testing.assert_close(r_out["params"][name], p, rtol=1e-5, atol=1e-6)
            assert all(0.0 <= h <= 1.0 for h in r_out["hidden"])
            if stage in (1, 2):
                # every bucket's all-gather left in flight by step(), or none when overlap is off
                assert r_out["pending"] == [r_out["buckets"] if overlap else 0] * 3
                assert r_out["buckets"] > 2 and r_out["first_layer_waited"] is (True if overlap else None)
                assert r_out["in_flight_after_state_dict"] == 0


@pytest.mark.parametrize("stage", [1, 2])
def test_one_rank_has_nothing_in_flight(stage):
    (out,) = run_ranks(_train, 1, stage, True)
    assert out["pending"] == [0, 0, 0] and out["in_flight_after_state_dict"] == 0
    assert out["hidden"] == [None] * 3  # nothing communicated, nothing timed
