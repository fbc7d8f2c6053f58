"""model.recompute = "selective" (pretrain/model/recompute.py) trains exactly as without recomputation: the same
layout, the same dropout draws, every loss and gradient norm bit for bit (fp32) over 4 steps — the recomputation
replays the forward's random state (torch's generators and megatron's tensor-parallel tracker) and reads each kept
GEMM output and in-place reduction back instead of running it again."""
import pytest
import torch

import pretrain.model.gpt as gpt
from gpt_harness import run_gpt_steps
from ranks import run_ranks

STEPS = 4  # bit for bit: a recomputed layer that differs shows in the first step's gradient norm
FP32 = ["precision.dtype=\"fp32\"", "model.attention=\"sdpa\"", "model.make_vocab_size_divisible_by=64",
        "train.global_batch_size=8"]
DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
LLAMA = ["model.position_embedding=\"rope\"", "model.mlp=\"swiglu\"", "model.norm=\"rmsnorm\"", "model.bias=false",
         "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.tie_embeddings=false"]
# (world, keys): TP 2 × DP 2 with SP at stage 3 (its gathers and reduce-scatters recomputed, dropout under the TP
# tracker), TP 2 without SP at stage 1 (the row-parallel all-reduces kept), PP 2 × DP 2 at stage 2, and megatron's
# local attention (its scores recomputed)
LAYOUTS = {
    "llama-TP2xDP2-SP-stage3": (4, LLAMA + DROPOUT + ["parallel.tensor=2", "parallel.sequence_parallel=true",
                                                     "zero.stage=3"]),
    "gpt-TP2xDP2-stage1": (4, DROPOUT + ["parallel.tensor=2", "zero.stage=1"]),
    "gpt-PP2xDP2-stage2": (4, DROPOUT + ["parallel.pipeline=2", "zero.stage=2"]),
    "gpt-local-DP2-stage3": (2, DROPOUT + ["model.attention=\"local\"", "zero.stage=3"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_selective_recomputation_trains_bit_for_bit_as_none(layout):
    world, keys = LAYOUTS[layout]
    none = run_ranks(run_gpt_steps, world, FP32 + keys, STEPS, None, True, timeout=300)
    selective = run_ranks(run_gpt_steps, world, FP32 + keys + ["model.recompute=\"selective\""], STEPS, None, True,
                          timeout=300)
    for a, b in zip(selective, none):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    assert none[0]["loss"][-1] < none[0]["loss"][0]  # it trained


def compiled_selective(rank, world_size, overrides, steps):
    gpt.COMPILE_BACKEND = "aot_eager"  # TorchDynamo's capture and AOTAutograd's graphs, no C++ build per rank
    return run_gpt_steps(rank, world_size, overrides + ["model.compile=true", "model.recompute=\"selective\""], steps,
                         None, True)


# (world, keys): TP 2 × DP 2 with SP; TP 1 × DP 2, the planner's layout for the Llama-3 8B recipe, where the
# checkpoint is traced into the layer's graph (torch then takes its own two contexts only: refused otherwise)
COMPILED_STEPS = 4  # a traced context's mistake shows in the first step; compiled ranks are the slow part
COMPILED_LAYOUTS = {"TP2xDP2-SP-stage3": (4, ["parallel.tensor=2", "parallel.sequence_parallel=true", "zero.stage=3"]),
                    "DP2-stage3": (2, ["zero.stage=3"])}


@pytest.mark.parametrize("layout", COMPILED_LAYOUTS)
def test_compiled_selective_recomputation_trains_like_eager_none(layout):
    """Compiled layers under selective recomputation (torch's checkpoint inside the compiled forward), stage 3, no
    dropout (a compiled graph draws its random numbers otherwise): = eager without recomputation within 1e-5
    (test_compile.py's tolerance)."""
    world, layout_keys = COMPILED_LAYOUTS[layout]
    keys = FP32 + LLAMA + layout_keys
    eager = run_ranks(run_gpt_steps, world, keys, COMPILED_STEPS, None, True, timeout=300)
    compiled = run_ranks(compiled_selective, world, keys, COMPILED_STEPS, timeout=600)
    for a, b in zip(compiled, eager):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor(a[key]), torch.tensor(b[key]), rtol=1e-5, atol=0)
