"""ZeRO++ engine modes on 4 CPU ranks as 2 nodes × 2: hpZ, hybrid sharding, qwZ, qgZ, bytes per link."""
from fractions import Fraction

import pytest

from gpt_harness import assert_close_runs
from zero3d.analysis.comm_model import link_bytes, zeropp_collectives

NODES = ("cluster.gpus_per_node=2",)  # 4 ranks: global ranks 0, 1 on node 0; 2, 3 on node 1
FP32 = ("train.global_batch_size=8",)
FP16 = ("train.global_batch_size=8", "precision.dtype=fp16", "precision.initial_loss_scale=1024")


def run(gpt_run, stage, extra=(), steps=10):
    return gpt_run(4, [f"zero.stage={stage}", *NODES, *extra], steps)


def assert_exact(ref, out, tol=1e-6):
    """Losses and gradient norms within `tol` relative, every step, every rank; parameters too."""
    assert_close_runs(ref, out, rtol=tol)


def inter_bytes(rank_out, step=-1):
    return Fraction(rank_out["comm"][step]["comm/inter_node_bytes"])


def padded_psi(rank_out):
    return sum(rank_out["padded_numels"].values())


# ---------------------------------------------------------------- bytes per link


def test_formula_matches_a_hand_count():
    """zeropp_collectives against the arithmetic done by hand: Ψ = 1000, b = 4, N = 4, m = 2 (k = 2)."""
    inter = link_bytes(zeropp_collectives("stage 3", 1000, 4, 2, value_bytes=4))[1]
    # 3 collectives × 4000 bytes × 3/4 sent per rank, half of it (k/N = 1/m) across the nodes.
    assert inter == Fraction(3 * 4000 * 3, 4 * 2) == 4500
    hpz = link_bytes(zeropp_collectives("+hpZ", 1000, 4, 2, value_bytes=4))[1]
    assert hpz == 3000  # the backward gather stays inside the node: 2 × 1500


def test_stage3_inter_node_bytes_per_step_match_the_formula(gpt_run):
    out = run(gpt_run, 3, FP32)
    psi = padded_psi(out[0])
    expected = link_bytes(zeropp_collectives("stage 3", psi, 4, 2, value_bytes=4))[1]
    for rank_out in out:
        for report in rank_out["comm"]:
            assert Fraction(report["comm/inter_node_bytes"]) == expected
    # per node (2 ranks): 3Ψb(N−1)/N crosses the node's links
    assert inter_bytes(out[0]) + inter_bytes(out[1]) == Fraction(3 * psi * 4 * 3, 4)


# ---------------------------------------------------------------- hpZ


@pytest.mark.parametrize("precision", [FP32, FP16], ids=["fp32", "fp16"])
def test_hpz_equals_stage3(gpt_run, precision):
    ref = run(gpt_run, 3, precision)
    out = run(gpt_run, 3, precision + ("zero.secondary_partition=node",))
    assert_exact(ref, out)
    psi = padded_psi(out[0])
    expected = link_bytes(zeropp_collectives("+hpZ", psi, 4, 2, value_bytes=out[0]["value_bytes"]))[1]
    assert inter_bytes(out[0]) == expected  # the backward gather never leaves the node
    assert "comm/all_gather/params_bwd/inter_node_bytes" not in out[0]["comm"][-1] or \
        out[0]["comm"][-1]["comm/all_gather/params_bwd/inter_node_bytes"] == 0
    # the secondary shard: Ψb/m bytes more than stage 3
    assert out[0]["state_bytes"]["secondary_params"] == psi * out[0]["value_bytes"] // 2
    assert "secondary_params" not in ref[0]["state_bytes"]
