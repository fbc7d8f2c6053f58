"""Megatron's sequence parallelism under zero3d: layer-norm gradients summed over TP before the DP step."""
import pytest
import torch

from dist import run_ranks
from gpt_harness import run_gpt_steps


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_sequence_parallel_trains_like_tensor_parallel(stage):
    """TP 2 × DP 2 with and without sequence parallelism: the same losses, norms and parameters."""
    layout = [f"zero.stage={stage}", "parallel.tensor=2", "train.global_batch_size=8"]
    ref = run_ranks(run_gpt_steps, 4, layout, 6)
    out = run_ranks(run_gpt_steps, 4, layout + ["parallel.sequence_parallel=true"], 6)
    torch.testing.assert_close(torch.tensor(out[0]["loss"]), torch.tensor(ref[0]["loss"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(out[0]["grad_norm"]), torch.tensor(ref[0]["grad_norm"]), rtol=1e-5, atol=0)
    for r_ref, r_out in zip(ref, out):
        for name, p in r_ref["params"].items():
            torch.testing.assert_close(r_out["params"][name], p, rtol=1e-5, atol=1e-5, msg=name)
    # the summed gradients are counted: tied_grads traffic appears only with sequence parallelism
    assert "comm/all_reduce/tied_grads/elements" in out[0]["comm"][0]
    assert "comm/all_reduce/tied_grads/elements" not in ref[0]["comm"][0]
