"""comm_model.dp_collectives by hand for every stage, the α term per collective, the per-node IB share, planner."""
import dataclasses
from fractions import Fraction

import pytest

from analysis import planner
from analysis.comm_model import (Links, collectives_per_pass, dp_collectives, dp_elements_per_step,
                                        link_bytes, link_seconds)

# Ψ = 1000 parameters, b = 4 bytes, N = 4 DP ranks as 2 nodes × 2 (m = 2, k = 2), B = 3 buckets per pass
PSI, B, N, M = 1000, 3, 4, 2


def counted(stage, mode="", accumulation=1):
    colls = dp_collectives(stage, mode, PSI, N, M, value_bytes=4, accumulation=accumulation, buckets=B)
    return (*link_bytes(colls), sum(c.steps for c in colls), sum(c.calls for c in colls))


@pytest.mark.parametrize("stage,accumulation,expected", [
    # a pass over N sends 4000·3/4 = 3000 bytes per rank; a ring of 4 ranks in 2 node blocks crosses on 2 of its
    # 4 edges, so half of it (1/m) is inter-node. Ring steps: 3 per reduce-scatter / all-gather, 6 per all-reduce.
    (0, 1, (3000, 3000, B * 6, B)),  # one all-reduce of 2 passes per bucket, once per step
    (0, 3, (3000, 3000, B * 6, B)),  # the accumulated gradients: still once per step
    (1, 1, (3000, 3000, 2 * B * 3, 2 * B)),  # reduce-scatter + all-gather, once per step
    (1, 3, (3000, 3000, 2 * B * 3, 2 * B)),
    (2, 1, (3000, 3000, 2 * B * 3, 2 * B)),
    (2, 3, (6000, 6000, 4 * B * 3, 4 * B)),  # 3 reduce-scatters (one per micro-batch) + 1 all-gather
])
def test_plain_stages_by_hand(stage, accumulation, expected):
    assert counted(stage, accumulation=accumulation) == expected


@pytest.mark.parametrize("stage,accumulation,expected", [
    # inside the node (m = 2): 4000·1/2 = 2000 bytes per collective, 1 step each; across the k = 2 nodes the
    # Ψ/m = 2000-byte shard all-reduced once per step: 2·2000·1/2 = 2000 bytes, 2 steps per bucket
    (1, 1, (4000, 2000, B * (1 + 1 + 2), 3 * B)),
    (1, 3, (4000, 2000, B * (1 + 1 + 2), 3 * B)),
    (2, 1, (4000, 2000, B * (1 + 1 + 2), 3 * B)),
    (2, 3, (8000, 2000, B * (3 + 1 + 2), 5 * B)),  # 3 node reduce-scatters, 1 gather, 1 cross all-reduce
])
def test_hybrid_by_hand(stage, accumulation, expected):
    assert counted(stage, "+hybrid", accumulation) == expected


def test_stage2_qgz_by_hand():
    # int4 + a 4-byte scale per 256: 132/256 bytes per element; inside the node 1 chunk of Ψ/m = 500,
    # across 1 chunk of Ψ/N = 250; the all-gather stays fp32 (3000 bytes, 1500 across); and a bucket's overflow
    # flag, one fp32 all-reduced over the 4 ranks: 2·4·3/4 = 6 bytes, half across, in a tree's 2·log2(4) = 4 steps
    q = Fraction(132, 256)
    assert counted(2, "+qgZ") == (500 * q + 1500 + B * 3, 250 * q + 1500 + B * 3, B * (1 + 1) + B * 3 + B * 4, 4 * B)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("accumulation", [1, 3])
def test_one_rank_per_node_sends_the_papers_passes(stage, accumulation):
    """m = 1: everything a rank sends crosses nodes, and it is dp_passes × Ψb(N−1)/N (the engine-checked
    element count of tests/dist/test_comm_accumulation.py)."""
    colls = dp_collectives(stage, "", 1000, 8, 1, value_bytes=2, accumulation=accumulation)
    assert link_bytes(colls) == (0, 2 * Fraction(dp_elements_per_step(stage, 1000, 8, accumulation)))


def test_refusals():
    with pytest.raises(ValueError, match=r"mode '\+hpZ' is invalid at stage 2; valid: '', '\+hybrid', '\+qgZ'"):
        dp_collectives(2, "+hpZ", 1000, 4, 2)
    with pytest.raises(ValueError, match=r"mode '\+hybrid' is invalid at stage 0; valid: ''"):
        dp_collectives(0, "+hybrid", 1000, 4, 2)
    with pytest.raises(ValueError, match="buckets = 0"):
        dp_collectives(1, "", 1000, 4, 2, buckets=0)


def test_collectives_per_pass_by_hand():
    # 1000 parameters in buckets of 300: 4 decay buckets + the no-decay one; 2 units of 500: 2 buckets each + 1
    assert collectives_per_pass(1000, 300, 2) == (5, 6)
    assert collectives_per_pass(1000, None, 4) == (2, 8)  # no CB: one fused buffer per decay class
    with pytest.raises(ValueError, match="bucket_elements = 0 is invalid"):
        collectives_per_pass(1000, 0, 2)


def test_alpha_is_paid_per_collective():
    """Stage 0 at tp 1 on 400 GPUs (25 nodes of 16): each bucket's all-reduce pays 2·399 IB ring steps of
    10 µs; 2001 buckets of 50M elements over a 100B model cost 2001·798·10 µs = 16 s of latency alone."""
    links = Links()
    one, many = (sum(link_seconds(c, links) for c in dp_collectives(0, "", 10**11, 400, 16, buckets=b))
                 for b in (1, 2001))
    assert many - one == pytest.approx(2000 * 798 * 10e-6)
    assert collectives_per_pass(10**11, 50_000_000, 127)[0] == 2001


def _node_ib_seconds(tp, gpus_per_node, nodes, send_bytes, ib_bandwidth):
    """Enumerate: global rank r on node r // gpus_per_node, TP groups of tp consecutive ranks, DP group j
    = ranks j, j + tp, j + 2tp, ... in ring (group-rank) order. Each rank sends `send_bytes` on its ring edge
    to the next; sum the crossing edges' bytes leaving each node over all its concurrent DP groups."""
    world = gpus_per_node * nodes
    leaving = [0] * nodes
    for j in range(tp):
        ring = list(range(j, world, tp))
        for i, src in enumerate(ring):
            dst = ring[(i + 1) % len(ring)]
            if src // gpus_per_node != dst // gpus_per_node:
                leaving[src // gpus_per_node] += send_bytes
    assert len(set(leaving)) == 1  # every node alike
    return leaving[0] / ib_bandwidth


@pytest.mark.parametrize("tp", [1, 4, 8])
def test_bandwidth_term_is_the_nodes_ib_share(tp):
    """link_seconds' inter-node term (α = 0, NVLink unbounded) equals the node's busiest NIC time counted edge
    by edge: one ring per DP group crosses each node boundary once, and the node's DP groups run at once."""
    links = Links(gpus_per_node=8, nvswitch_bandwidth=1e30, nvswitch_latency=0, ib_bandwidth_per_node=400e9,
                  ib_latency=0)
    dp, m = 32 // tp, 8 // tp
    psi = 10**9
    gather = next(c for c in dp_collectives(1, "", psi, dp, m) if c.purpose == "params")
    send = psi * 2 * Fraction(dp - 1, dp)  # what each rank sends in the all-gather
    assert link_seconds(gather, links) == pytest.approx(_node_ib_seconds(tp, 8, 4, send, 400e9), rel=1e-12)


# H100-like: 8 GPUs per node, 900 GB/s NVLink, 8 × 400 Gb/s IB per node, 4 nodes
H100ISH = dataclasses.replace(planner.PAPER_CLUSTER, name="h100-ish", gpus_per_node=8, nodes=4, gpu_memory_bytes=80e9,
                              intra_node_bandwidth=900e9, inter_node_bandwidth=400e9, peak_flops=989e12)


def test_hybrid_stage2_beats_plain_stage2_by_the_hand_computed_time():
    """tp 1, 32 GPUs: N = 32 DP ranks, m = 8 per node, k = 4; a short-sequence model whose backward hides
    little. Plain stage 2: reduce-scatter and all-gather rings over 32 ranks (1/8 of each rank's bytes on its
    1/8 share of IB, 31 IB steps per bucket); hybrid: both inside the node on NVLink (7 steps), then the Ψ/8
    shard all-reduced over 4 nodes (6 IB steps per bucket)."""
    found = planner.plan(H100ISH, layers=24, hidden=2048, heads=16, seq=128, global_batch=32, tp_choices=[1],
                         stages=(2,))
    pick = {c.zero.zeropp: c for c in found if c.micro_batch == 1 and not c.zero.pa}
    plain, hybrid = pick[""], pick["+hybrid"]
    psi, n, m, k = plain.memory.params_per_rank, 32, 8, 4
    b_calls = -(-psi // 50_000_000) + 1  # 50M-element decay buckets + the no-decay one
    full = psi * 2
    backward = plain.compute_s * 3 / 4  # one micro-batch (accumulation 1), full recompute
    ring = full * (n - 1) / n
    one_pass = b_calls * (n - 1) * 10e-6 + max(ring * (1 - 1 / m) / 900e9, ring / m / 50e9)
    assert plain.dp_s == pytest.approx(max(0.0, one_pass - backward) + one_pass, rel=1e-9)
    node = b_calls * (m - 1) * 5e-6 + full * (m - 1) / m / 900e9
    cross = b_calls * 2 * (k - 1) * 10e-6 + 2 * full / m * (k - 1) / k / 50e9
    assert hybrid.dp_s == pytest.approx(max(0.0, node - backward) + node + cross, rel=1e-9)
    assert hybrid.step_s < plain.step_s and hybrid.samples_per_s > plain.samples_per_s
    # memory: gradients and Adam states over 8 ranks instead of 32 (fp16: b_g = 2, K = 12)
    assert hybrid.memory.model_state_bytes - plain.memory.model_state_bytes == pytest.approx(
        psi * (2 + 12) * (1 / 8 - 1 / 32))
