"""Every distributed feature off the symmetric 2 × 2 (issue #40): six ranks as 2 nodes × 3 and as 3 nodes × 2
(stages 2 and 3 through hybrid and qgZ, hpZ, qwZ, qgZ int8 and int4; plain stages 1 and 2 over DP 4: test_zero.py), TP 2 × DP 3 (with SP at stage 2) and PP 3 × DP 2 — each held to one
DP 6 stage 0 run from the same weights, and its bytes per link to the formula for its own N, m and k."""
from fractions import Fraction

import pytest
import torch

from gpt_harness import BASE, run_gpt_steps
from ranks import run_ranks
from analysis.comm_model import dp_collectives, link_bytes

# ~35 s of 6-rank runs, most of it the module's shared fixture: beside the compute lane, to even the two lanes' wall
# times (tools/run_suite.py; the compute lane ran 936 s beside the side lane's 877 on 2026-11-29)
pytestmark = pytest.mark.side_lane

WORLD, STEPS = 6, 3
# 3 layers (PP 3 splits them one a stage); a padded vocabulary of 128 at TP 1 and TP 2, so every layout builds
# the same model and `layout_free_init` gives it the same weights; micro-batch 2: 12 = 2 × DP 6 = 2 × 2 × DP 3.
COMMON = ("model.num_layers=3", "model.make_vocab_size_divisible_by=64", "train.global_batch_size=12")
N2X3, N3X2, ONE_NODE = "cluster.gpus_per_node=3", "cluster.gpus_per_node=2", "cluster.gpus_per_node=6"
QWZ, QGZ4, QGZ8 = "zero.quantize_weights=int8", "zero.quantize_gradients=int4", "zero.quantize_gradients=int8"
HPZ, HYBRID = "zero.secondary_partition=node", "zero.hybrid=node"
# name -> (overrides, the formula's (stage, mode, DP ranks per node)); None: not a DP-only layout
FP16 = ("precision.dtype=fp16", "precision.initial_loss_scale=1024")
KEEP = "zero.param_persistence_threshold=40"  # the norms' and biases' 32 elements stay whole on every rank
# name -> (overrides, the formula's (stage, mode, DP ranks per node)); None: a TP or PP layout on one node.
# Keys that interact ride along (docs/testing.md's combinations): the persistence threshold with hpZ and hybrid,
# fp16 with qwZ + qgZ int4, bf16 with qgZ int8.
RUNS = {
    "stage0": (("zero.stage=0", N2X3), (0, "", 3)),
    "stage3": (("zero.stage=3", N2X3), (3, "", 3)),
    "hpz_2x3": (("zero.stage=3", HPZ, N2X3), (3, "+hpZ", 3)),
    "hybrid2_2x3": (("zero.stage=2", HYBRID, N2X3), (2, "+hybrid", 3)),
    "qwz_hpz_qgz4_fp16_2x3": (("zero.stage=3", QWZ, HPZ, QGZ4, *FP16, N2X3), (3, "qwZ+hpZ+qgZ", 3)),
    "hpz_keep_3x2": (("zero.stage=3", HPZ, KEEP, N3X2), (3, "+hpZ", 2)),
    "hybrid3_keep_3x2": (("zero.stage=3", HYBRID, KEEP, N3X2), (3, "+hybrid", 2)),
    "qgz8_bf16_3x2": (("zero.stage=2", QGZ8, 'precision.dtype="bf16"', N3X2), (2, "+qgZ", 2)),
    "tp2_dp3_stage3": (("parallel.tensor=2", "zero.stage=3", ONE_NODE), None),  # SP refuses stage 3 (config)
    "tp2_dp3_sp_stage2": (("parallel.tensor=2", "parallel.sequence_parallel=true", "zero.stage=2", ONE_NODE), None),
    "pp3_dp2_stage2": (("parallel.pipeline=3", "zero.stage=2", ONE_NODE), None),
}
EXACT = [name for name in RUNS if "qgz" not in name and "qwz" not in name and name != "stage0"]


def _node_groups(overrides: tuple) -> dict:
    """The node groups init_layout builds for a node-aware mode, as global ranks."""
    import torch.distributed as dist

    from pretrain.config import load_config
    from pretrain.runtime.layout import destroy_model_parallel_groups, init_layout
    topo = init_layout(load_config(None, BASE + list(COMMON) + list(overrides)))
    node = topo.node
    out = {"dp_global_ranks": list(node.dp_global_ranks), "node": node.node, "local": node.local,
           "intra": dist.get_process_group_ranks(node.intra_group) if node.intra_group else [],
           "inter": dist.get_process_group_ranks(node.inter_group) if node.inter_group else []}
    destroy_model_parallel_groups()
    return out


def _runs(rank, world_size):
    """Every RUNS entry in one launch (megatron's groups rebuilt between them), each from the same weights."""
    from pretrain.runtime.layout import destroy_model_parallel_groups
    out = {"groups": {gpn: _node_groups(("zero.stage=3", HPZ, gpn)) for gpn in (N2X3, N3X2)}}
    for name, (overrides, _) in RUNS.items():
        run = run_gpt_steps(rank, world_size, list(COMMON) + list(overrides), STEPS, layout_free_init=True)
        out[name] = {k: run[k] for k in ("loss", "grad_norm", "skipped", "comm", "padded_numels", "value_bytes",
                                         "bucket_numels", "param_numels", "tp_rank", "pp_rank", "dp_rank", "params")}
        destroy_model_parallel_groups()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_runs, WORLD, timeout=600)


@pytest.mark.parametrize("gpn,per_node", [(N2X3, 3), (N3X2, 2)], ids=["2x3", "3x2"])
def test_node_groups_at_2x3_and_3x2(runs, gpn, per_node):
    """Global rank g (DP rank g at TP 1) on node g // m at local index g % m: the intra-node group is its node's
    m ranks, the inter-node group the k = 6 / m ranks of its local index, one a node."""
    for g, out in enumerate(runs):
        groups = out["groups"][gpn]
        assert groups["dp_global_ranks"] == list(range(WORLD))
        assert (groups["node"], groups["local"]) == (g // per_node, g % per_node)
        assert groups["intra"] == [r for r in range(WORLD) if r // per_node == g // per_node]
        assert groups["inter"] == [r for r in range(WORLD) if r % per_node == g % per_node]
        assert len(groups["inter"]) == WORLD // per_node


def assert_same_run(ref, out, tol=1e-6, params=True):
    """Losses and gradient norms within `tol` relative, every step, every rank; DP-only layouts' parameters
    within 10·tol (Adam's update of a near-zero gradient amplifies a last-bit difference of the sum order)."""
    for r_ref, r_out in zip(ref, out):
        assert r_out["skipped"] == r_ref["skipped"] == [False] * STEPS
        torch.testing.assert_close(torch.tensor(r_out["loss"]), torch.tensor(r_ref["loss"]), rtol=tol, atol=0)
        torch.testing.assert_close(torch.tensor(r_out["grad_norm"]), torch.tensor(r_ref["grad_norm"]),
                                   rtol=tol, atol=0)
        for name, p in r_ref["params"].items() if params else ():
            torch.testing.assert_close(r_out["params"][name], p, rtol=10 * tol, atol=10 * tol, msg=name)


def test_the_reference_trains(runs):
    ref = [r["stage0"] for r in runs]
    assert ref[0]["loss"][-1] < (1 - 1e-3) * ref[0]["loss"][0]  # it moves by far more than the tolerance
    assert all(r["loss"] == ref[0]["loss"] for r in ref)


@pytest.mark.parametrize("name", EXACT)
def test_every_layout_and_mode_equals_dp6_stage0(runs, name):
    """Stage 3, hpZ (2 × 3 and 3 × 2), hybrid (stage 2 at 2 × 3, 3 at 3 × 2), TP 2 × DP 3 with SP, PP 3 × DP 2: the DP 6
    stage 0 run (fp32, 1e-6); parameters compared where the layout holds them whole (TP 1, PP 1)."""
    overrides = RUNS[name][0]
    whole = not any(o.startswith(("parallel.tensor", "parallel.pipeline")) for o in overrides)
    ref = [r["stage0"] for r in runs]
    out = [r[name] for r in runs]
    if not whole:  # compare the loss each rank reports (the last pipeline stage's, broadcast) and the norm
        assert_same_run(ref, out, params=False)
    else:
        assert_same_run(ref, out)


@pytest.mark.parametrize("name", [n for n in RUNS if "qgz" in n or "qwz" in n])
def test_quantized_modes_stay_near_stage3(runs, name):
    """qwZ int8 + hpZ + qgZ int4 in fp16 (2 × 3) and qgZ int8 at stage 2 in bf16 (3 × 2): 4 steps within 1% of the
    exact fp32 run, every rank the same loss (the quantized sums are the same on every rank), nothing skipped."""
    ref = [r["stage3"] for r in runs]
    out = [r[name] for r in runs]
    for r_ref, r_out in zip(ref, out):
        assert r_out["loss"] == out[0]["loss"] and r_out["skipped"] == [False] * STEPS
        torch.testing.assert_close(torch.tensor(r_out["loss"]), torch.tensor(r_ref["loss"]), rtol=1e-2, atol=0)
    assert out[0]["loss"] != ref[0]["loss"]  # quantization did run


def expected_link_bytes(name: str, rank_out: dict) -> tuple:
    """(intra, inter) bytes a step by dp_collectives for N = 6 and this layout's m and k; Ψ the rank's sharded
    flat buffers, each bucket padded up to a multiple of the ranks it is sharded over (hybrid: the node's m);
    quantized chunks in whole blocks of 256 (`pieces`); persistent parameters (the threshold) all-reduced whole
    over the DP group, 2·Ψ_kept·b·(N − 1)/N, a 1/m share of it across nodes (the ring's model), or with hybrid
    over the node's m ranks, 2·Ψ_kept·b·(m − 1)/m inside it, then over the k nodes, 2·Ψ_kept·b·(k − 1)/k across."""
    stage, mode, per_node = RUNS[name][1]
    shard_over = per_node if mode == "+hybrid" else WORLD
    sharded = {g: sizes for g, sizes in rank_out["bucket_numels"].items() if not g.startswith("persistent/")}
    pieces = [-(-raw // shard_over) * shard_over for sizes in sharded.values() for raw in sizes]
    assert sum(pieces) == sum(rank_out["padded_numels"][g] for g in sharded)  # the padding rule, bucket by bucket
    b, quantized = rank_out["value_bytes"], "qgz" in name or "qwz" in name
    intra, inter = link_bytes(dp_collectives(stage, mode, sum(pieces), WORLD, per_node, value_bytes=b, weight_bits=8,
                                             grad_bits=4 if "qgz4" in name else 8, block=256,
                                             pieces=pieces if quantized else None))
    kept = sum(n for g, n in rank_out["padded_numels"].items() if g.startswith("persistent/"))
    nodes = WORLD // per_node
    if kept and mode == "+hybrid":
        intra, inter = (intra + Fraction(2 * kept * b * (per_node - 1), per_node),
                        inter + Fraction(2 * kept * b * (nodes - 1), nodes))
    elif kept:
        reduce = Fraction(2 * kept * b * (WORLD - 1), WORLD)
        intra, inter = intra + reduce - reduce / per_node, inter + reduce / per_node
    return intra, inter


@pytest.mark.parametrize("name", [n for n, (_, formula) in RUNS.items() if formula is not None])
def test_bytes_per_link_equal_the_formula_for_n6(runs, name):
    """Each rank, each step: intra- and inter-node bytes = the formula for N = 6 and this layout's m (3 or 2) and
    k (2 or 3), int8 / int4 and the block padding included."""
    if "keep" in name:  # the threshold kept the parameters of <= 40 elements whole (norms, small biases), only them
        kept = [n for g, sizes in runs[0][name]["bucket_numels"].items() if g.startswith("persistent/") for n in sizes]
        assert sum(kept) == sum(n for _, n, _ in runs[0][name]["param_numels"] if n <= 40) > 0
    for rank_out in (r[name] for r in runs):
        intra, inter = expected_link_bytes(name, rank_out)
        assert inter > 0
        for report in rank_out["comm"]:
            # the counts are exact fractions, reported as floats: m = 3 splits are not binary fractions
            assert ((report["comm/intra_node_bytes"], report["comm/inter_node_bytes"])
                    == (float(intra), float(inter))), (name, rank_out["dp_rank"])


@pytest.mark.parametrize("name", ["tp2_dp3_stage3", "tp2_dp3_sp_stage2", "pp3_dp2_stage2"])
def test_tp_and_pp_ranks_at_tp2_dp3_and_pp3_dp2(runs, name):
    """megatron's order: TP 2 × DP 3 puts global rank g at TP rank g % 2, DP rank g // 2; PP 3 × DP 2 at PP
    rank g // 2, DP rank g % 2. On one node every DP byte stays inside it: the stage's DP formula, all intra."""
    stage = int(name[-1])
    dp, tp = (3, 2) if name.startswith("tp2") else (2, 1)
    for g, r in enumerate(runs):
        out = r[name]
        if tp == 2:
            assert (out["tp_rank"], out["dp_rank"], out["pp_rank"]) == (g % 2, g // 2, 0)
        else:
            assert (out["tp_rank"], out["dp_rank"], out["pp_rank"]) == (0, g % 2, g // 2)
        psi = sum(out["padded_numels"].values())
        # micro-batch 2: 12 samples are 2 (TP 2 × DP 3) or 3 (PP 3 × DP 2) micro-batches a rank a step
        accumulation = 12 // (2 * dp)
        intra, inter = link_bytes(dp_collectives(stage, "", psi, dp, dp, value_bytes=4, accumulation=accumulation))
        for report in out["comm"]:
            assert (report["comm/intra_node_bytes"], report["comm/inter_node_bytes"]) == (float(intra), 0), (name, g)
