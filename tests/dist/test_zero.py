"""ZeRO-DP stages 1 and 2 against stage 0 on a tiny megatron GPTModel: losses, norms, params, bytes, comm."""
import math
from fractions import Fraction

import pytest
import torch

from ranks import run_ranks
from gpt_harness import REFERENCE_STEPS, assert_bucket_layout, assert_close_runs

STEPS = REFERENCE_STEPS  # each step compared; the loss of one step is one batch's, so "it trains" compares 3-step means
LAYOUTS = [(1, 2), (1, 4), (2, 2)]  # (TP, DP); TP 2 × DP 3, DP 6 on 2 nodes × 3 and 3 × 2: test_asymmetric.py


def run(gpt_run, tp, dp, stage, extra=(), steps=STEPS, inject_inf_at=None):
    overrides = [f"parallel.tensor={tp}", f"zero.stage={stage}", *extra]
    return gpt_run(tp * dp, overrides, steps, inject_inf_at)


@pytest.mark.parametrize("tp,dp", LAYOUTS)
@pytest.mark.parametrize("accum", [1, 2])
def test_stages_match_stage0_fp32(tp, dp, accum, gpt_run):
    # micro 2 × DP × accum = global batch
    extra = [f"train.global_batch_size={2 * dp * accum}"]
    ref = run(gpt_run, tp, dp, 0, extra)
    assert sum(ref[0]["loss"][-3:]) < sum(ref[0]["loss"][:3])  # it trains
    for stage in (1, 2):
        assert_close_runs(ref, run(gpt_run, tp, dp, stage, extra), rtol=1e-5)


def test_stage1_bf16_is_bitwise_stage0(gpt_run):
    """Stage 1 reduces the same bf16 sums as stage 0 (one reduce-scatter of the same buffer instead of
    one all-reduce) and updates the same fp32 masters: today the runs are bit for bit the same."""
    extra = ["precision.dtype=bf16", "train.global_batch_size=8"]
    ref, out = run(gpt_run, 2, 2, 0, extra), run(gpt_run, 2, 2, 1, extra)
    assert_close_runs(ref, out, rtol=0)
    assert_trains(out, tolerance=0)


def test_stage2_bf16_matches_stage0_within_bf16_rounding(gpt_run):
    """Stage 2 accumulates the reduced bf16 shard per micro-batch (stage 0 the local gradient, then
    reduces): one more bf16 rounding (u = 2^-9) of the gradient a step. Over S steps the loss, a mean
    over T tokens of independent per-token errors, moves by at most S·u/√T relative."""
    extra = ["precision.dtype=bf16", "train.global_batch_size=8"]
    steps, tokens = STEPS, 8 * 16  # global batch × seq_length
    ref, out = run(gpt_run, 2, 2, 0, extra, steps=steps), run(gpt_run, 2, 2, 2, extra, steps=steps)
    rtol = steps * 2.0 ** -9 / math.sqrt(tokens)
    for r_ref, r_out in zip(ref, out):
        torch.testing.assert_close(torch.tensor(r_out["loss"]), torch.tensor(r_ref["loss"]), rtol=rtol, atol=0)
    assert_trains(out, tolerance=rtol)


def assert_trains(out, tolerance):
    """The loss drops below its start by more than the tolerance and every parameter tensor moved from its start
    (but the word embedding and output layer of TP rank 1, whose rows 128-255 are the vocabulary's padding: no token
    reaches them, no probability goes to them: no gradient, and weight decay is 0)."""
    padding = ("embedding.word_embeddings.weight", "output_layer.weight")
    for r in out:
        assert (r["loss"][0] - min(r["loss"])) / r["loss"][0] > tolerance, r["loss"]
        for name, p in r["params"].items():
            if name not in padding or r["tp_rank"] == 0:
                assert not torch.equal(p, r["params_init"][name]), f"{name} never updated"


@pytest.mark.parametrize("stage,formula", [
    (0, lambda psi, n: dict(params=2 * psi, grads=2 * psi, master_params=4 * psi, optimizer_states=8 * psi)),
    (1, lambda psi, n: dict(params=2 * psi, grads=2 * psi, master_params=4 * psi // n, optimizer_states=8 * psi // n)),
    (2, lambda psi, n: dict(params=2 * psi, grads=2 * psi // n, master_params=4 * psi // n,
                            optimizer_states=8 * psi // n)),
])
def test_model_state_bytes_bf16(stage, formula, gpt_run):
    """Stage 1: 4Ψ + 12Ψ/N_d; stage 2: 2Ψ + 14Ψ/N_d; Ψ per TP rank, each bucket padded to N_d."""
    tp, dp = 2, 2
    out = run(gpt_run, tp, dp, stage, ["precision.dtype=bf16", "train.global_batch_size=4"], steps=1)
    for rank_out in out:
        assert not rank_out["megatron_gloo_dp_group"]  # init_layout builds no gloo duplicates of the groups
        # the buckets by flat.py's rule, each padded to a multiple of N_d: Σ ceil(bucket / N_d)·N_d a group
        psi_padded = assert_bucket_layout(rank_out, stage, dp)
        assert {name: sum(sizes) for name, sizes in rank_out["bucket_numels"].items()} == rank_out["group_numels"]
        expected = {k: 0 for k in ("params", "grads", "master_params", "optimizer_states")}
        for name, padded in rank_out["padded_numels"].items():
            for k, v in formula(padded, dp).items():
                expected[k] += v
        assert rank_out["state_bytes"] == expected
        # the paper's total on the padded Ψ, exactly (N_d divides each padded bucket)
        paper = {0: 16 * psi_padded, 1: 4 * psi_padded + 12 * psi_padded // dp,
                 2: 2 * psi_padded + 14 * psi_padded // dp}[stage]
        assert sum(rank_out["state_bytes"].values()) == paper


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("tp,dp", [(1, 4), (2, 2)])
def test_communication_volume(stage, tp, dp, gpt_run):
    """Per rank per step: 2Ψ(N_d−1)/N_d elements (gradients + parameters), Ψ counted over the flat
    buffers: each bucket of the parameters padded to a multiple of N_d."""
    out = run(gpt_run, tp, dp, stage, [f"train.global_batch_size={2 * dp}"], steps=2)
    for rank_out in out:
        psi_padded = assert_bucket_layout(rank_out, stage, dp)
        assert rank_out["comm_elements"] == [Fraction(2 * psi_padded * (dp - 1), dp)] * 2
        kinds = {k for k in rank_out["comm"][0] if k.endswith("/elements")}
        expected = {0: {"comm/all_reduce/grads/elements"},
                    1: {"comm/reduce_scatter/grads/elements", "comm/all_gather/params/elements"},
                    2: {"comm/reduce_scatter/grads/elements", "comm/all_gather/params/elements"}}[stage]
        assert kinds == expected | {"comm/all_reduce/grad_norm/elements", "comm/total/elements"}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_one_collective_per_bucket(stage, gpt_run):
    """Per step and group: stage 0 one all-reduce per bucket; stages 1/2 one reduce-scatter and one
    all-gather per bucket (not one per (bucket, owner) or per group)."""
    dp = 4
    out = run(gpt_run, 1, dp, stage, [f"train.global_batch_size={2 * dp}", "zero.bucket_elements=3000"], steps=2)
    for rank_out in out:
        buckets = sum(rank_out["buckets"].values())
        assert buckets > len(rank_out["buckets"])  # several buckets per group
        for comm in rank_out["comm"]:
            calls = {k.removeprefix("comm/").removesuffix("/calls"): v for k, v in comm.items()
                     if k.endswith("/calls") and not k.startswith(("comm/total", "comm/all_reduce/grad_norm"))}
            assert calls == ({"all_reduce/grads": buckets} if stage == 0 else
                             {"reduce_scatter/grads": buckets, "all_gather/params": buckets})


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fp16_overflow_on_one_rank_skips_everywhere(stage, gpt_run):
    extra = ["precision.dtype=fp16", "precision.hysteresis=1", "precision.initial_loss_scale=1024",
             "train.global_batch_size=4"]
    out = run(gpt_run, 1, 2, stage, extra, steps=4, inject_inf_at=(1, 1))  # step 1, rank 1 only
    for rank_out in out:
        assert rank_out["skipped"] == [False, True, False, False]
        assert rank_out["loss_scale"] == [1024.0, 512.0, 512.0, 512.0]
        checks = rank_out["param_checksum"]
        assert checks[1] == checks[0]  # the skipped step left every parameter unchanged
        assert checks[2] != checks[1]  # and the next step updated them
    assert out[0]["param_checksum"] == out[1]["param_checksum"]


def test_fp16_overflow_on_one_tp_rank_skips_everywhere(gpt_run):
    """TP 2 × DP 2: an inf on TP rank 1 of DP rank 0 only. Every rank (its TP peer and the other DP
    replica included) skips that step and backs the scale off; the others step on."""
    extra = ["precision.dtype=fp16", "precision.hysteresis=1", "precision.initial_loss_scale=1024",
             "train.global_batch_size=4"]
    out = run(gpt_run, 2, 2, 2, extra, steps=3, inject_inf_at=(1, 1))
    assert [(r["tp_rank"], r["dp_rank"]) for r in out][1] == (1, 0)
    for rank_out in out:
        assert rank_out["skipped"] == [False, True, False]
        assert rank_out["loss_scale"] == [1024.0, 512.0, 512.0]
        assert rank_out["param_checksum"][1] == rank_out["param_checksum"][0]
        assert rank_out["param_checksum"][2] != rank_out["param_checksum"][1]


def test_tied_embeddings_match_stage0(gpt_run):
    extra = ["model.tie_embeddings=true", "train.global_batch_size=4"]
    ref = run(gpt_run, 2, 2, 0, extra, steps=6)
    for stage in (1, 2):
        assert_close_runs(ref, run(gpt_run, 2, 2, stage, extra, steps=6), rtol=1e-5)


def _staging_peak(rank, world, num_layers):
    import zero3d
    from gpt_harness import BASE, SyntheticTokens
    from pretrain.config import load_config
    from pretrain.model.gpt import build_model, gpt_loss
    from pretrain.runtime.layout import init_layout
    from pretrain.train import Batches, engine_settings
    cfg = load_config(None, BASE + ["zero.stage=2", "zero.bucket_elements=2000", "train.global_batch_size=4",
                                    f"model.num_layers={num_layers}"])
    topo = init_layout(cfg)
    engine = zero3d.wrap_model(build_model(cfg, topo.device), engine_settings(cfg),
                               zero3d.ParallelGroups(topo.dp_group, topo.tp_rank))
    batches = Batches(SyntheticTokens(128, 16), cfg.train, cfg.data, topo)
    engine.backward(gpt_loss(engine, batches.get(0, 0)))
    largest = max(b.numel for g in engine.groups.values() for b in g.buckets)
    total = sum(g.layout.padded_numel for g in engine.groups.values())
    return engine.staging_bytes_peak, largest * 4, total * 4


def test_stage2_staging_memory_is_bounded_by_buckets():
    """CB: stage 2 holds a few buckets of full-size gradients at once, however deep the model."""
    shallow = run_ranks(_staging_peak, 2, 2)[0]
    deep = run_ranks(_staging_peak, 2, 8)[0]
    for peak, largest_bucket_bytes, full_bytes in (shallow, deep):
        # in flight (2) + the bucket filling in each of the two parameter groups
        assert peak <= 4 * largest_bucket_bytes
    assert deep[1] == shallow[1] and deep[2] > 3 * shallow[2]  # same bound, 3x the model
