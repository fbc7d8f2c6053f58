"""SDPA core attention trains like megatron's local attention (fp32, 10 steps), one run per attention and
layout: TP 1; TP 2 × DP 2 with Pa+cpu (stage 2); TP 2 × PP 2 with SP (Pa and SP are mutually exclusive)."""
import pytest
import torch

STEPS = 10
LAYOUTS = {
    "tp1": (1, ["train.global_batch_size=4"]),
    "tp2_dp2_pa_cpu": (4, ["parallel.tensor=2", "model.recompute=full", "zero.partition_activations=true",
                           "zero.cpu_checkpointing=true", "zero.stage=2", "train.global_batch_size=4"]),
    "tp2_pp2_sp": (4, ["parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true",
                       "zero.stage=1", "train.global_batch_size=4"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sdpa_trains_like_local_attention(layout, gpt_run):
    world, overrides = LAYOUTS[layout]
    overrides = overrides + ["optimizer.lr=1e-2", "optimizer.min_lr=1e-2"]  # visible progress in 10 steps
    local = gpt_run(world, overrides + ["model.attention=local"], STEPS)
    sdpa = gpt_run(world, overrides + ["model.attention=sdpa"], STEPS)
    assert local[0]["loss"][-1] < local[0]["loss"][0]  # it trains
    # Losses and gradient norms (the acceptance); parameters are not compared: the key bias's gradient is
    # zero up to rounding (softmax is shift-invariant), and Adam turns that rounding noise into ±lr steps.
    for r_local, r_sdpa in zip(local, sdpa):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(r_sdpa[key]), torch.tensor(r_local[key]), rtol=1e-5, atol=0)
