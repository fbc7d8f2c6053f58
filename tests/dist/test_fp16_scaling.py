"""fp16 loss scaling does not depend on the data-parallel size: identical data on every rank gives
the single-rank loss-scale and skipped-step sequence at DP 3, at every stage."""
import pytest
import torch

from ranks import run_ranks

STEPS = 16


def _scale_trajectory(rank, world, stage, predivide):
    import torch.distributed as dist
    import torch.nn as nn

    import zero3d
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)).half()
    settings = zero3d.EngineSettings(
        zero=zero3d.ZeroConfig(stage=stage, bucket_elements=1500, grad_predivide_factor=predivide), dtype=torch.float16,
        optimizer=zero3d.OptimizerConfig(clip_grad=1.0, lr=1e-3),
        # grows every 2 clean steps from near the fp16 limit: the scale keeps probing overflow
        loss_scale=zero3d.LossScaleConfig(initial_loss_scale=2.0**14, growth_interval=2, hysteresis=1))
    engine = zero3d.wrap_model(model, settings, zero3d.ParallelGroups(dp_group=None))
    scales, skipped = [], []
    for step in range(STEPS):
        data = torch.Generator().manual_seed(step)  # the same batch on every rank
        x, y = torch.randn(8, 16, generator=data).half(), 4 * torch.randn(8, 8, generator=data)
        loss = (engine(x).float() - y).pow(2).sum()
        engine.backward(loss)
        result = engine.step(1e-3)
        scales.append(result.loss_scale)
        skipped.append(result.skipped)
    return scales, skipped


@pytest.fixture(scope="module")
def single_rank():
    return run_ranks(_scale_trajectory, 1, 0, 0.0)[0]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_dp3_matches_single_rank(single_rank, stage):
    scales, skipped = single_rank
    assert any(skipped) and not all(skipped)  # the scale both overflows and grows
    for rank_out in run_ranks(_scale_trajectory, 3, stage, 0.0):
        assert rank_out == (scales, skipped)


def test_sum_then_divide_skips_more_at_dp3(single_rank):
    """grad_predivide_factor = 1 (fp16 sum over ranks, then ÷N_d): the sum overflows where one
    rank's gradient does not, so DP 3 skips more steps — what the default (÷N_d first) avoids."""
    _, skipped = single_rank
    _, skipped_dp3 = run_ranks(_scale_trajectory, 3, 0, 1.0)[0]
    assert sum(skipped_dp3) > sum(skipped)


def test_predivide_factor_2_at_dp4_sums_like_one_rank_doubling_its_gradient():
    """grad_predivide_factor = 2 at DP 4 with the same batch everywhere: the fp16 sum is 4·g/2 = 2g, then
    ÷2. One rank with factor 1/2 forms the same 2g (÷0.5, then ×0.5), so it overflows on the same
    steps: the same loss-scale and skip sequence. The default (÷4 first, the sum g) follows another."""
    default = run_ranks(_scale_trajectory, 1, 0, 0.0)[0]
    doubled = run_ranks(_scale_trajectory, 1, 0, 0.5)[0]
    assert doubled != default and sum(doubled[1]) > sum(default[1])  # the factor matters here
    for rank_out in run_ranks(_scale_trajectory, 4, 1, 2.0):
        assert rank_out == doubled
