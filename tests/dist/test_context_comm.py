"""Context parallelism's K/V collectives, counted by zero3d's Comm in the engine's CommStats, equal the docs' formula."""
from fractions import Fraction

import pytest

from gpt_harness import run_gpt_steps
from ranks import run_ranks
from analysis.comm_model import context_bytes_per_step

STEPS = 2  # the counts restart every step: the second must equal the first
FP32 = ["precision.dtype=\"fp32\"", "model.attention=\"sdpa\""]
LLAMA = ["model.position_embedding=\"rope\"", "model.mlp=\"swiglu\"", "model.norm=\"rmsnorm\"", "model.bias=false",
         "model.num_query_groups=2", "model.ffn_hidden_size=64"]
# gpt_harness.BASE: 2 layers, hidden 32, 4 heads (d = 8), seq 16, micro-batch 2, global batch 8
LAYERS, HIDDEN, HEADS, SEQ, MICRO, GLOBAL = 2, 32, 4, 16, 2, 8
CASES = {  # name: (tp, cp, KV groups, recompute, extra overrides)
    "gpt C2, no recompute": (1, 2, HEADS, "none", []),
    "llama TP2×C2, megatron's full recompute": (2, 2, 2, "full", LLAMA + ["parallel.tensor=2"]),
    "gpt TP2×C2, ZeRO-R Pa recompute": (2, 2, HEADS, "full", ["parallel.tensor=2", "zero.partition_activations=true"]),
}


@pytest.mark.parametrize("case", CASES)
def test_cp_bytes_per_step_counted_by_comm_equal_the_formula(case):
    """Every rank, every step: the bytes under comm/…/context_kv equal comm_model.context_bytes_per_step
    (docs/estimator.md, Context parallelism) exactly — the forward all-gathers (again in backward under full
    recomputation, megatron's or ZeRO-R's) and the backward reduce-scatters of K and V, A = 8 / 2 = 4
    micro-batches, g·d = groups × 8 wide over all TP ranks, fp32 — and reach the logged report."""
    tp, cp, groups, recompute, extra = CASES[case]
    world, accumulation = tp * cp, GLOBAL // MICRO  # no data parallelism: N_d = 1
    expected = context_bytes_per_step(seq=SEQ, kv_width=groups * HIDDEN // HEADS, layers=LAYERS, micro_batch=MICRO,
                                      accumulation=accumulation, tp=tp, cp=cp, act_bytes=4, recompute=recompute)
    passes = 3 if recompute == "full" else 2  # all-gathers + reduce-scatters, in gathers' widths
    ranks = run_ranks(run_gpt_steps, world, FP32 + extra + [f"parallel.context={cp}",
                                                            f"model.recompute=\"{recompute}\""], STEPS, timeout=120)
    for rank in ranks:
        for step in range(STEPS):
            counted = {op: b for (op, tag), b in rank["comm_bytes"][step].items() if tag == "context_kv"}
            assert sum(counted.values(), Fraction(0)) == expected, (case, step, counted)
            assert counted == {"all_gather": expected * (passes - 1) / passes, "reduce_scatter": expected / passes}
            report = rank["comm"][step]
            assert (report["comm/all_gather/context_kv/bytes"] + report["comm/reduce_scatter/context_kv/bytes"]
                    == float(expected))
    assert expected > 0
