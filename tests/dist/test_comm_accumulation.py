"""Communication per step with gradient accumulation, measured, against the per-micro-batch formula."""
from fractions import Fraction

import pytest

from analysis.comm_model import dp_elements_per_step, dp_passes
from gpt_harness import REFERENCE_STEPS

# The cached runs of test_zero.py and test_stage3.py (gpt_harness.REFERENCE_STEPS each): TP 2 × DP 2,
# micro-batch 2, global batch 8 = 2 micro-batches per step.
TP, DP, ACCUM = 2, 2, 2
# Independently of the engine: stages 0-1 reduce the accumulated gradients once (2 passes), stage 2
# reduce-scatters every micro-batch (A) and gathers once (1), stage 3 gathers twice and reduces once
# per micro-batch (3A); each pass moves Ψ(N_d−1)/N_d elements per rank.
PASSES = {0: 2, 1: 2, 2: ACCUM + 1, 3: 3 * ACCUM}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_comm_per_step_with_two_micro_batches(stage, gpt_run):
    out = gpt_run(TP * DP, [f"parallel.tensor={TP}", f"zero.stage={stage}",
                            f"train.global_batch_size={2 * DP * ACCUM}"], REFERENCE_STEPS)
    for rank_out in out:
        psi = sum(rank_out["padded_numels"].values())
        expected = Fraction(PASSES[stage] * psi * (DP - 1), DP)
        for comm in rank_out["comm"]:
            measured = sum(v for k, v in comm.items() if k.endswith("/elements")
                           and k.split("/")[2] in ("grads", "params", "params_bwd"))
            assert measured == expected
        # the α-β model and the planner count the same
        assert dp_passes(stage, ACCUM) == PASSES[stage]
        assert dp_elements_per_step(stage, psi, DP, ACCUM) == expected
