"""Megatron's sequence parallelism under zero3d: layer-norm gradients summed over TP before the DP step."""
import pytest

from ranks import run_ranks
from gpt_harness import assert_close_runs, run_gpt_steps


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sequence_parallel_trains_like_tensor_parallel(stage):
    """TP 2 × DP 2 with and without sequence parallelism: the same losses, norms and parameters. Stage 3 keeps its
    32-element vectors (every sequence-parallel norm and bias) whole as persistent parameters, summed over TP at the
    step; its sharded ones, summed at the end of backward, are tested at TP 2 × C 2 (test_context_parallel.py)."""
    persistent = ["zero.param_persistence_threshold=32"] if stage == 3 else []
    layout = [f"zero.stage={stage}", "parallel.tensor=2", "train.global_batch_size=8"] + persistent
    ref = run_ranks(run_gpt_steps, 4, layout, 6)
    out = run_ranks(run_gpt_steps, 4, layout + ["parallel.sequence_parallel=true"], 6)
    assert_close_runs(ref, out, rtol=1e-5)
    # the summed gradients are counted: tied_grads traffic appears only with sequence parallelism
    assert "comm/all_reduce/tied_grads/elements" in out[0]["comm"][0]
    assert "comm/all_reduce/tied_grads/elements" not in ref[0]["comm"][0]
