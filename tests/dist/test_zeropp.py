"""ZeRO++ engine modes on 4 CPU ranks as 2 nodes × 2: hpZ, hybrid sharding, qwZ, qgZ, bytes per link."""
from fractions import Fraction

import pytest
import torch

from checkpoint_harness import train_segment
from gpt_harness import assert_bucket_layout
from pretrain.checkpoint.read import read_json
from ranks import run_ranks
from analysis.comm_model import dp_collectives, link_bytes, zeropp_collectives
from analysis.estimate import extra_state_bytes, model_state_bytes

pytestmark = pytest.mark.side_lane  # ~50 CPU-s: in the side lane, to even the lanes (tools/run_suite.py)

NODES = ("cluster.gpus_per_node=2",)  # 4 ranks: global ranks 0, 1 on node 0; 2, 3 on node 1
FP32 = ("train.global_batch_size=8",)
FP16 = ("train.global_batch_size=8", "precision.dtype=fp16", "precision.initial_loss_scale=1024")


def run(gpt_run, stage, extra=(), steps=6):
    return gpt_run(4, [f"zero.stage={stage}", *NODES, *extra], steps)


def assert_exact(ref, out, loss_tol=1e-6, norm_tol=1e-6, param_tol=1e-5):
    """Losses and gradient norms within 1e-6 relative, every step, every rank; parameters within 1e-5 (None:
    not compared) (Adam's update of a near-zero gradient turns a last-bit difference of its sum order — plain stage 1
    against stage 0 differs by 1.7e-6 here — into that much)."""
    for r_ref, r_out in zip(ref, out):
        torch.testing.assert_close(torch.tensor(r_out["loss"]), torch.tensor(r_ref["loss"]), rtol=loss_tol, atol=0)
        torch.testing.assert_close(torch.tensor(r_out["grad_norm"]), torch.tensor(r_ref["grad_norm"]),
                                   rtol=norm_tol, atol=0)
        assert r_out["params"].keys() == r_ref["params"].keys()
        for name, p in r_ref["params"].items() if param_tol is not None else ():
            torch.testing.assert_close(r_out["params"][name], p, rtol=param_tol, atol=param_tol, msg=name)


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
    assert ("comm/all_gather/params_bwd/inter_node_bytes" not in out[0]["comm"][-1]
            or out[0]["comm"][-1]["comm/all_gather/params_bwd/inter_node_bytes"] == 0)
    # the secondary shard: Ψb/m bytes more than stage 3, by the estimator's formula and by hand
    precision = "fp16" if precision == FP16 else "fp32"
    assert (out[0]["state_bytes"]["secondary_params"] == extra_state_bytes("+hpZ", psi, 4, 2, precision)
            == psi * {"fp32": 4, "fp16": 2}[precision] / 2)
    assert "secondary_params" not in ref[0]["state_bytes"]


# ---------------------------------------------------------------- hybrid sharding


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", [FP32, FP16], ids=["fp32", "fp16"])
def test_hybrid_equals_unsharded(gpt_run, stage, precision):
    ref = run(gpt_run, 0, precision)
    out = run(gpt_run, stage, precision + ("zero.hybrid=node",))
    # fp16 gradients summed in another order differ in their last bits (3 digits): plain stages 1-3
    # against stage 0 differ by 2.6e-6 in the loss and 1.4e-4 in the gradient norm here, hybrid by less;
    # Adam's update turns that into ±lr on near-zero gradients' parameters, so those are compared in fp32.
    assert_exact(ref, out, *((1e-6, 1e-6) if precision == FP32 else (5e-6, 3e-4, None)))
    # sharded over the node's 2 ranks, not 4: every shard is half the model
    for rank_out in out:
        assert all(numel % 2 == 0 for numel in rank_out["padded_numels"].values())
    psi = padded_psi(out[0])
    b = out[0]["value_bytes"]
    # bytes per link by dp_collectives (accumulation 1): stage 0's all-reduce over 2 nodes × 2, and hybrid's
    # node-local collectives plus the Ψ/m gradient shard all-reduced across the nodes, to the byte
    assert link_bytes(dp_collectives(0, "", padded_psi(ref[0]), 4, 2, value_bytes=b)) == (
        Fraction(ref[0]["comm"][-1]["comm/intra_node_bytes"]), inter_bytes(ref[0]))
    expected = link_bytes(dp_collectives(stage, "+hybrid", psi, 4, 2, value_bytes=b))
    assert inter_bytes(out[0]) == expected[1]  # only the gradient shard's all-reduce crosses nodes
    assert Fraction(out[0]["comm"][-1]["comm/intra_node_bytes"]) == expected[0]
    # memory: shards over m = 2, not N = 4: the stage's states over N plus the estimator's extra
    if precision == FP32:
        over_n = sum(model_state_bytes(psi, stage, 4, "fp32"))
        assert sum(out[0]["state_bytes"].values()) == over_n + extra_state_bytes("+hybrid", psi, 4, 2, "fp32", stage)
    if stage == 3:
        assert out[0]["state_bytes"]["params"] == psi * b // 2
    elif precision == FP32:  # plain stages 1 and 2 over all 4 ranks (stage 2's run is the qgZ test's reference)
        plain = run(gpt_run, stage, precision)
        plain_psi = padded_psi(plain[0])
        assert inter_bytes(plain[0]) == link_bytes(dp_collectives(stage, "", plain_psi, 4, 2, value_bytes=4))[1]
        assert sum(plain[0]["state_bytes"].values()) == sum(model_state_bytes(plain_psi, stage, 4, "fp32"))


HYBRID_CKPT = ["zero.stage=2", "zero.hybrid=node", *NODES, "train.global_batch_size=8"]
# Resumed into another hybrid layout (stage 3's shards over the node's 2 ranks) and into plain stage 3 on
# 2 ranks (one node's worth: another world size; the global batch of 8 stays, as 2 micro-batches a rank).
HYBRID_RESUMES = {"hybrid_stage3": (4, ["zero.stage=3", "zero.hybrid=node", *NODES, "train.global_batch_size=8"]),
                  "plain_stage3_2_ranks": (2, ["zero.stage=3", "train.global_batch_size=8"])}


def test_hybrid_checkpoint_resumes_at_its_layout_and_at_others(tmp_path):
    """Saved after step 3 of 6 by 2 nodes × 2 holding node-local shards (each node's ranks offer the same
    pieces in parameter coordinates; DCP writes each once; the layout states it); resumed there bitwise,
    and within 1e-6 by hybrid stage 3 on the same nodes and by plain stage 3 on 2 ranks."""
    whole = run_ranks(train_segment, 4, HYBRID_CKPT, tmp_path, 0, 6, (3,), timeout=300)
    manifest = read_json(tmp_path / "step_00000003" / "checkpoint.json")
    assert manifest["layout"]["hybrid"] == "node" and manifest["layout"]["gpus_per_node"] == 2
    again = run_ranks(train_segment, 4, HYBRID_CKPT, tmp_path, 3, 6, (), True, timeout=300)
    assert again[0]["loss"] == whole[0]["loss"][3:]
    for name, (world, layout) in HYBRID_RESUMES.items():
        other = run_ranks(train_segment, world, layout, tmp_path, 3, 6, (), True, timeout=300)
        assert other[0]["resumed"]["step"] == 3 and other[0]["resumed"]["consumed_samples"] == 3 * 8, name
        torch.testing.assert_close(torch.tensor(other[0]["loss"]), torch.tensor(whole[0]["loss"][3:]),
                                   rtol=1e-6, atol=0, msg=name)


# ---------------------------------------------------------------- qwZ, qgZ

BLOCK = 256  # zero.quant_block: elements per quantization scale (qwZ and qgZ)
ZEROPP_ALL = ("zero.quantize_weights=int8", "zero.secondary_partition=node", "zero.quantize_gradients=int4",
              f"zero.quant_block={BLOCK}")


def test_quantized_modes_train_like_stage3_and_cut_inter_node_bytes_4x(gpt_run):
    """60 steps of the tiny GPT with qwZ + hpZ + qgZ int4 end within 2% of stage 3's loss (the mean of
    the last 10 steps' batches: 3.1316 against 3.1308 measured, 0.03%; at 100 steps 2.465 against 2.473, 0.3%; at 200
    steps 1.974 against 1.952, 1.1%), from 4.86 at the start; each step sends exactly 12021 bytes a rank across the
    nodes, 0.124 of stage 3's 96624. One layer, one bucket per unit: ~7 s a run."""
    steps = 60
    small = FP32 + ("model.num_layers=1", "zero.bucket_elements=100000", "optimizer.lr=3e-3", "optimizer.min_lr=3e-3")
    ref = run(gpt_run, 3, small, steps=steps)
    out = run(gpt_run, 3, small + ZEROPP_ALL, steps=steps)
    end_ref, end_out = (sum(r[0]["loss"][-10:]) / 10 for r in (ref, out))
    assert end_ref < 0.7 * ref[0]["loss"][0]  # it trains (3.13 from 4.86)
    assert abs(end_out - end_ref) <= 0.02 * end_ref
    n, m, k = 4, 2, 2  # DP ranks, DP ranks a node, nodes
    for rank_ref, rank_out in zip(ref, out):
        # Buckets (one a group): embedding 4608, layer matrices 12288, layer vectors 416, final norm 64, output
        # layer 4096 elements (Ψ = 21472), no padding at N = 4; each rank quantizes its piece of a bucket in blocks
        # of 256, the last zero-padded, each block sent as its codes and one fp32 scale.
        assert_bucket_layout(rank_out, 3, n, bucket_elements=100000)
        pieces = [-(-size // n) for sizes in rank_out["bucket_numels"].values() for size in sizes]
        assert sorted(pieces) == [16, 104, 1024, 1152, 3072]
        blocks = [-(-piece // BLOCK) for piece in pieces]  # 1 + 1 + 4 + 5 + 12 = 23
        # qwZ forward all-gather, int8: N pieces of 23 blocks × (256 + 4) bytes, ring (N−1)/N, 1/m across nodes
        gather = n * sum(blocks) * (BLOCK + 4) * Fraction(n - 1, n) / m
        # hpZ backward all-gather: inside the node. qgZ int4, across nodes: a piece to each of the k − 1 other
        # nodes' peers, 23 blocks × (128 + 4) bytes; and qgZ's overflow flag, one fp32 all-reduce a bucket
        grads = (k - 1) * sum(blocks) * (BLOCK // 2 + 4)
        flags = len(pieces) * 2 * 4 * Fraction(n - 1, n) / m
        assert (gather, grads, flags) == (8970, 3036, 15)
        # stage 3: forward and backward all-gathers and the reduce-scatter, 3Ψb(N−1)/N, 1/m across nodes
        plain = link_bytes(zeropp_collectives("stage 3", padded_psi(rank_ref), n, m, value_bytes=4))[1]
        assert plain == 3 * 21472 * 4 * Fraction(n - 1, n) / m == 96624
        # comm_model's formula, given the buckets' padded sizes, counts the same blocks and flags
        padded = [size for sizes in rank_out["bucket_numels"].values() for size in sizes]
        assert link_bytes(dp_collectives(3, "qwZ+hpZ+qgZ", padded_psi(rank_out), n, m, value_bytes=4, block=BLOCK,
                                         pieces=padded))[1] == 12021
        for step in range(steps):
            assert inter_bytes(rank_out, step) == gather + grads + flags == 12021  # 0.124 of stage 3's
            assert inter_bytes(rank_ref, step) == plain


def _overflow_rank(rank, world_size, quantize):
    """A 2-layer model, stage 2 + qgZ on 2 nodes × 2; rank 1's input holds an inf at step 1."""
    import torch.distributed as dist
    import zero3d
    from zero3d.config import ZeroConfig
    from zero3d.comm.topology import build_node_topology
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    settings = zero3d.EngineSettings(zero=ZeroConfig(stage=2, bucket_elements=40, quantize_gradients=quantize,
                                                     quant_block=4))
    topo = build_node_topology(None, gpus_per_node=2)
    engine = zero3d.wrap_model(model, settings, zero3d.ParallelGroups(dp_group=None, node_topology=topo))
    skipped = []
    for step in range(3):
        x = torch.ones(4, 8)
        if step == 1 and rank == 1:
            x[0, 0] = float("inf")
        engine.backward(engine(x).sum())
        skipped.append(engine.step(1e-3).skipped)
    return skipped


def test_qgz_overflow_on_one_rank_skips_the_step_on_every_rank():
    """An inf has no quantization scale: the ranks agree on it before quantizing, and all skip."""
    for skipped in run_ranks(_overflow_rank, 4, "int4", timeout=120):
        assert skipped == [False, True, False]


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_qgz_at_stage2_stays_within_its_quantization_error(gpt_run, bits):
    """Stage 2's bucket reduce-scatter through qgZ: 6 steps track plain stage 2 (losses within 1e-3;
    int4's 7 levels per block err more than int8's 127), and every DP rank keeps identical parameters."""
    ref = run(gpt_run, 2, FP32)
    out = run(gpt_run, 2, FP32 + (f"zero.quantize_gradients={bits}",))
    torch.testing.assert_close(torch.tensor(out[0]["loss"]), torch.tensor(ref[0]["loss"]), rtol=1e-3, atol=0)
    assert out[0]["loss"] != ref[0]["loss"]  # quantized: not bit-identical
    for rank_out in out[1:]:
        assert rank_out["param_checksum"] == out[0]["param_checksum"]


def test_hybrid_accumulates_micro_batches_and_crosses_nodes_once_per_step(gpt_run):
    """Hybrid stage 2 with 2 micro-batches per step (global batch 8 over 4 ranks, micro-batch 1) equals stage 0
    within 1e-6 over 3 steps, and sends the node-local gradient shard (Ψ/m values) across the nodes once per
    step, not once per micro-batch: by hand, a ring all-reduce over k nodes sends 2·(Ψb/m)·(k−1)/k per rank,
    here (m = k = 2) Ψb/2, all of it inter-node; nothing else crosses (the reduce-scatter and the parameter
    all-gather stay inside the node; the norm's all-reduce is over the world group, not a DP collective)."""
    accumulate = ("train.global_batch_size=8", "train.micro_batch_size=1")
    ref = run(gpt_run, 0, accumulate, steps=3)
    out = run(gpt_run, 2, accumulate + ("zero.hybrid=node",), steps=3)
    assert_exact(ref, out)
    psi, b, m, k = padded_psi(out[0]), out[0]["value_bytes"], 2, 2
    for rank_out in out:
        for report in rank_out["comm"]:
            assert (Fraction(report["comm/inter_node_bytes"]) == 2 * Fraction(psi * b, m) * Fraction(k - 1, k)
                    == Fraction(psi * b, 2))
            assert Fraction(report["comm/all_reduce/grads/inter_node_bytes"]) == Fraction(psi * b, 2)
            assert report["comm/all_reduce/grads/calls"] == sum(rank_out["buckets"].values())  # one per bucket
