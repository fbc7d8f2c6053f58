"""Pipeline parallelism (megatron-core's 1F1B schedule) under zero3d's engine, tied embeddings across stages."""
import pytest
import torch

from ranks import run_ranks
from gpt_harness import run_gpt_steps

STEPS = 6


def run(world, overrides, steps=STEPS):
    return run_ranks(run_gpt_steps, world, list(overrides), steps, None, True, timeout=300)


def assert_same_training(ref, out, rtol=1e-5):
    torch.testing.assert_close(torch.tensor(out[0]["loss"]), torch.tensor(ref[0]["loss"]), rtol=rtol, atol=0)
    torch.testing.assert_close(torch.tensor(out[0]["grad_norm"]), torch.tensor(ref[0]["grad_norm"]), rtol=rtol, atol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_two_stages_train_like_one(tied):
    """PP=2 against PP=1 from the same weights: same losses and gradient norms (the tied copy counted once)."""
    extra = ["model.tie_embeddings=true"] if tied else []
    ref = run(1, ["zero.stage=0", "train.global_batch_size=4"] + extra)
    assert ref[0]["loss"][-1] < ref[0]["loss"][0]
    out = run(2, ["zero.stage=0", "parallel.pipeline=2", "train.global_batch_size=4"] + extra)
    assert_same_training(ref, out)
    assert out[0]["loss"] == out[1]["loss"]  # broadcast from the last stage


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_stages_under_pipeline_match_stage0(stage, tied):
    """PP=2 × DP=2 with ZeRO stage 1/2 against PP=2 × DP=1 stage 0; tied copies stay identical."""
    extra = ["parallel.pipeline=2", "train.global_batch_size=8"] + (["model.tie_embeddings=true"] if tied else [])
    ref = run(2, ["zero.stage=0"] + extra)
    out = run(4, [f"zero.stage={stage}"] + extra)
    assert_same_training(ref, out)
    if tied:  # first stage's embedding and last stage's output layer: the same weight after training
        first = next(r for r in out if r["pp_rank"] == 0 and r["dp_rank"] == 0)
        last = next(r for r in out if r["pp_rank"] == 1 and r["dp_rank"] == 0)
        torch.testing.assert_close(first["params"]["embedding.word_embeddings.weight"],
                                   last["params"]["output_layer.weight"], rtol=0, atol=0)


def test_tensor_pipeline_and_data_parallel_together():
    """TP 2 × PP 2 × DP 2 (8 ranks) with ZeRO stage 2 against TP 2 × PP 2 × DP 1 stage 0."""
    layout = ["parallel.pipeline=2", "parallel.tensor=2", "train.global_batch_size=4"]
    ref = run(4, ["zero.stage=0"] + layout, steps=4)
    out = run(8, ["zero.stage=2"] + layout, steps=4)
    assert out[0]["loss"][-1] < out[0]["loss"][0]
    assert_same_training(ref, out)


def test_sequence_parallel_norms_at_stage_2_under_pipeline_sum_every_micro_batch():
    """TP 2 × PP 2 with sequence parallelism, 2 micro-batches a step: megatron's schedule finishes the backward once
    for both, so stage 2 holds each sequence-parallel norm's gradient whole across the two micro-batches before
    summing it over TP; the same losses and gradient norms as stage 0 at that layout (which sums it at the step)."""
    layout = ["parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true", "train.global_batch_size=4"]
    ref = run(4, ["zero.stage=0"] + layout, steps=4)
    out = run(4, ["zero.stage=2"] + layout, steps=4)
    assert out[0]["loss"][-1] < out[0]["loss"][0]
    assert_same_training(ref, out)
