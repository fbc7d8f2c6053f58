"""Planner with ZeRO++ modes: per-link α-β time at stage 3, node modes only with >= 2 DP ranks per node."""
import dataclasses
import math

import pytest

from analysis import __main__ as cli
from analysis import planner

# H100-like: 8 GPUs per node on 900 GB/s NVLink, 8 × 400 Gb/s InfiniBand per node, 4 nodes
H100ISH = dataclasses.replace(planner.PAPER_CLUSTER, name="h100-ish", gpus_per_node=8, nodes=4,
                              gpu_memory_bytes=80e9, intra_node_bandwidth=900e9,
                              inter_node_bandwidth=8 * 400e9 / 8, peak_flops=989e12)
NV_ALPHA, IB_ALPHA = 5e-6, 10e-6  # comm_model.Links' assumed latencies per ring step
# a small model with short sequences: its stage-3 gathers outweigh its compute (inter-node bound)
SHAPE = dict(layers=24, hidden=2048, heads=16, seq=128, global_batch=16)


def _seconds(intra, inter, steps):
    """α·steps (InfiniBand's when bytes cross nodes) + the slower link: NVLink per GPU, or the GPU's
    1/8 share of its node's InfiniBand."""
    alpha = IB_ALPHA if inter else NV_ALPHA
    return alpha * steps + max(intra / 900e9, inter / (400e9 / 8))


def test_inter_node_bound_layout_picks_zeropp_at_the_hand_computed_alpha_beta_time():
    """tp 2 on 8-GPU nodes: 4 DP ranks per node, 16 in all over 4 nodes. The top layout is
    qwZ+hpZ+qgZ; its exposed DP time is the α-β time of its collectives less the compute it hides under."""
    found = planner.plan(H100ISH, **SHAPE, tp_choices=[2], stages=(3,))
    top = found[0]
    assert top.zero.zeropp == "qwZ+hpZ+qgZ" and (top.dp, top.accumulation) == (16, 1)
    psi, n, m, k = top.memory.params_per_rank, 16, 4, 4
    # collectives per pass: 50M-element buckets of the decay buffer + 1 no-decay bucket; stage 3 gathers
    # each of the 26 units (embedding, 24 layers, output layer) per bucket, decay and no-decay apart
    b_calls = math.ceil(psi / 50e6) + 1
    g_calls = 26 * (math.ceil(psi / (26 * 50e6)) + 1)
    assert (b_calls, g_calls) == (16, 52)  # Ψ = 0.7B per TP slice
    q_w, q_g = 1 + 4 / 256, 0.5 + 4 / 256  # int8 / int4 bytes per element + a 4-byte scale per 256
    gather = psi * q_w * (n - 1) / n  # forward all-gather, quantized, a ring over 16 ranks in 4 nodes
    comm = (_seconds(gather * (1 - 1 / m), gather / m, g_calls * (n - 1))  # 1/m of it crosses nodes
            + _seconds(psi * 2 * (m - 1) / m, 0, g_calls * (m - 1))  # hpZ: backward gather inside the node, fp16
            + _seconds(psi / m * q_g * (m - 1), 0, b_calls * (m - 1))  # qgZ all-to-all inside the node
            + _seconds(0, psi / n * q_g * (k - 1), b_calls * (k - 1))  # qgZ all-to-all across the nodes
            # qgZ's overflow flag: one fp32 all-reduced per bucket (a ring's bytes, 1/m across nodes), a tree's
            # 2·log2(16) = 8 latency steps
            + _seconds(8 * (n - 1) / n * b_calls * (1 - 1 / m), 8 * (n - 1) / n * b_calls / m, b_calls * 8))
    assert top.dp_s == pytest.approx(comm - top.compute_s, rel=1e-9) and top.dp_s > 0
    assert top.step_s == pytest.approx(top.compute_s + top.mp_s + top.dp_s, rel=1e-9)
    plain = next(c for c in found if c.zero == planner.ZeroChoice(3) and c.micro_batch == top.micro_batch)
    # plain stage 3: three fp16 rings of Ψ·2·15/16, each with 1/4 of it across nodes
    ring = psi * 2 * (n - 1) / n
    assert plain.dp_s == pytest.approx(sum(_seconds(ring * (1 - 1 / m), ring / m, calls * (n - 1))
                                           for calls in (g_calls, g_calls, b_calls)) - plain.compute_s, rel=1e-9)
    assert top.step_s < plain.step_s
    # memory: hpZ's secondary shard adds Ψb/m over stage 3
    assert top.memory.total_bytes - plain.memory.total_bytes == pytest.approx(psi * 2 / m)


def test_one_dp_rank_per_node_never_gets_hpz_or_hybrid():
    """tp 8 fills an 8-GPU node: 1 DP rank per node, so hpZ and hybrid (and the combination) are skipped;
    the quantized modes, which need no node-local peers, are still weighed."""
    found = planner.plan(H100ISH, **SHAPE, tp_choices=[8], stages=(3,))
    assert {c.zero.zeropp for c in found} == {"", "+qwZ", "+qgZ"}


def test_cli_plan_rank_prints_the_modes(capsys):
    argv = "--plan rank --layers 24 --hidden 2048 --heads 16 --seq 128 --global-batch 16 --gpus 32 --top 200".split()
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for mode in ("P_os+g+p + hpZ ", "P_os+g+p + qwZ ", "P_os+g+p + qgZ ", "+ qwZ+hpZ+qgZ", "P_os+g+p + hybrid ",
                 "P_os + hybrid ", "P_os+g + hybrid ", "P_os+g + qgZ "):
        assert mode in out
