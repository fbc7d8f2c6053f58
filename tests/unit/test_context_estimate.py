"""Context parallelism in the estimator and the comm model (issue #41): by-hand numbers, cp = 1 unchanged, refusals."""
import dataclasses

import pytest

from analysis import estimate as est
from analysis.comm_model import context_bytes_per_step
from model_shape.gpt import GPTShape

# A small Llama-shaped model: S = 64, h = 64, a = 8 heads in 2 KV groups (d = 8), SwiGLU f = 128, RoPE, no biases.
S, H, A, GROUPS, D, F, L = 64, 64, 8, 2, 8, 128, 2
SHAPE = GPTShape(layers=L, hidden=H, heads=A, query_groups=GROUPS, seq=S, vocab=1000, ffn=F, mlp="swiglu",
                 norm="rmsnorm", position_embedding="rope", bias=False)
B, T, E = 2, 2, 2  # micro-batch, TP, bf16 activation bytes
PSI = 100_672  # parameters per TP rank at t = 2, by hand below
LAYOUT = dict(gpus=8, tp=T, micro_batch=B, precision="bf16", attention="fused", loss_chunk_tokens=0)


def test_psi_by_hand():
    """A layer: QKV h·(h + 2·g·d) + proj h² + fc1 2·h·f + fc2 f·h split over t, two RMSNorm weights whole;
    embedding and output: the vocabulary padded to 1024 (128 × t) × h / t each; the final norm h."""
    layer = (H * (H + 2 * GROUPS * D) + H * H + 2 * H * F + F * H) // T + 2 * H
    assert L * layer + 2 * (1024 * H // T) + H == PSI == SHAPE.params(T)


def layer_bytes_by_hand(cp: int) -> int:
    """One layer's activations on a TP rank with cp context ranks, each rank s = S/C tokens of a sequence:
    whole s·b·h·(4e + 2) (norm, QKV and fc1 inputs, two 1-byte masks); split over t s·b·e·(2h + 2·g·d + 2f + f)
    (Q, projection input, local K and V, SwiGLU's fc1 output, the activation output) and the fused attention's
    fp32 logsumexp a·s·b·4. With cp > 1 (pretrain/model/context.py): SDPA keeps K and V gathered over all S
    tokens, unrepeated (g/t groups), so the other ranks' S − s tokens add 2·e·(S − s)·b·(g/t)·d; no mask
    tensor (the kernels' lower-right causal bias)."""
    s = S // cp
    whole = s * B * H * (4 * E + 2)
    split = s * B * E * (2 * H + 2 * GROUPS * D + 2 * F + F) + A * s * B * 4
    if cp == 1:
        return whole + split // T
    kv = 2 * E * (S - s) * B * (GROUPS // T) * D
    return whole + split // T + kv


def test_layer_bytes_by_hand_numbers():
    """The formula's numbers, written out once (whole + (split + logsumexp)/t + the other ranks' K and V): cp 1:
    s = 64; cp 2: s = 32, K and V 2·2·32·2·1·8 = 2048; cp 4: s = 16, K and V 2·2·48·2·1·8 = 3072."""
    assert layer_bytes_by_hand(1) == 81_920 + (139_264 + 4_096) // 2 == 153_600
    assert layer_bytes_by_hand(2) == 40_960 + (69_632 + 2_048) // 2 + 2_048 == 78_848
    assert layer_bytes_by_hand(4) == 20_480 + (34_816 + 1_024) // 2 + 3_072 == 41_472


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_working_set_and_tokens_per_rank(cp):
    """Without recomputation the working set is L layers' activations; the logits are this rank's S/C tokens'
    (b·s·V_pad/t, megatron's loss on bf16 logits: each beside its fp32 copy, 2 + 4 bytes); the model states are
    sharded over dp·cp = gpus/t = 4 ranks whatever cp is (stage 2: the gradients and optimizer states; stage 3: the
    parameters too). The activation fields are stage 2's, the step's totals (stage 3's hold what its peak moment
    holds, stage3_peak.py)."""
    m = est.estimate(SHAPE, *est.job_of(stage=2, cp=cp, **LAYOUT))
    s = S // cp
    assert m.working_set_bytes == L * layer_bytes_by_hand(cp)
    assert m.logits_bytes == B * s * 1024 // T * (2 + 4)
    assert (m.param_bytes, m.grad_bytes, m.optimizer_bytes) == (PSI * 2, PSI * 2 / 4, PSI * 12 / 4)
    m3 = est.estimate(SHAPE, *est.job_of(stage=3, cp=cp, **LAYOUT))
    assert (m3.param_bytes, m3.grad_bytes, m3.optimizer_bytes) == (PSI * 2 / 4, PSI * 2 / 4, PSI * 12 / 4)


@pytest.mark.parametrize("cp", [2, 4])
def test_recompute_checkpoints(cp):
    """Full recomputation: one checkpoint per layer of s = S/C tokens (L·b·s·h·e), one layer's working set."""
    m = est.estimate(SHAPE, *est.job_of(stage=2, cp=cp, recompute="full", **LAYOUT))
    assert m.checkpoint_bytes == L * B * (S // cp) * H * E
    assert m.working_set_bytes == layer_bytes_by_hand(cp)


@pytest.mark.parametrize("cp, fc2, attention, expected", [(2, 16_384, -12_288, 16_384), (4, 8_192, -4_096, 8_192),
                                                          (8, 4_096, 0, 4_096)])
def test_activation_gradients_at_the_rank_tokens(cp, fc2, attention, expected):
    """The larger of fc2's moment at s = S/C tokens, s·b·h·e + s·b·f·e/t, and the attention's backward: the
    gradients of the gathered K and V and of Q and the output, (2·e·S·b·g·d + 2·e·s·b·h)/t, less the freed MLP
    activations 3·s·b·f·e/t (SwiGLU): here fc2's moment is the larger at every cp."""
    s = S // cp
    assert fc2 == s * B * H * E + s * B * F * E // T
    assert attention == (2 * E * S * B * GROUPS * D + 2 * E * s * B * H - 3 * s * B * F * E) // T
    terms = est.buffer_terms(SHAPE, stage=3, psi=PSI, micro_batch=B, tp=T, bucket_elements=None,
                             precision="bf16", prefetch_units=1, attention="fused", cp=cp)
    assert terms["activation gradients"] == expected


@pytest.mark.parametrize("stage, divisor", [(1, 4), (2, 4), (3, 4)])
def test_model_states_over_data_times_context(stage, divisor):
    """gpus = 16, t = 2, cp = 4: dp = 2, ZeRO over dp·cp = 8 ranks (the same shards as cp = 1's dp = 8)."""
    layout = LAYOUT | {"gpus": 16}
    m, one = est.estimate(SHAPE, *est.job_of(stage=stage, cp=4, **layout)), est.estimate(SHAPE, *est.job_of(stage=stage, **layout))
    assert m.optimizer_bytes == PSI * 12 / 8 == one.optimizer_bytes
    assert m.grad_bytes == (PSI * 2 / 8 if stage >= 2 else PSI * 2) == one.grad_bytes


def test_cp_one_is_the_default():
    """cp = 1 gives exactly the breakdown without the argument (every existing number unchanged)."""
    for attention in ("local", "fused"):
        for recompute in ("none", "full"):
            layout = LAYOUT | {"attention": attention, "recompute": recompute}
            assert est.estimate(SHAPE, *est.job_of(cp=1, **layout)) == est.estimate(SHAPE, *est.job_of(**layout))


@pytest.mark.parametrize("recompute, passes", [("none", 2), ("full", 3)])
def test_context_bytes_per_step_by_hand(recompute, passes):
    """Per layer per micro-batch, a forward all-gather of K and V: 2·S·b·(g/t)·d·e·(C−1)/C = 2·64·2·8·2·3/4 = 3072
    bytes at C = 4; the backward reduce-scatter the same; recompute repeats the gather. L = 2, A = 3."""
    got = context_bytes_per_step(seq=S, kv_width=GROUPS * D, layers=L, micro_batch=B, accumulation=3, tp=T, cp=4,
                                 act_bytes=E, recompute=recompute)
    assert got == 2 * 3 * passes * 3072
    assert context_bytes_per_step(seq=S, kv_width=GROUPS * D, layers=L, micro_batch=B, accumulation=3, tp=T, cp=1,
                                  act_bytes=E, recompute=recompute) == 0


@pytest.mark.parametrize("cp, message", [
    (0, "cp = 0 is invalid; must be an integer >= 1"),
    (-2, "cp = -2 is invalid; must be an integer >= 1"),
    (1.5, "cp = 1.5 is invalid; must be an integer >= 1"),
    (True, "cp = True is invalid; must be an integer >= 1"),
    (3, "cp = 3 does not split seq = 64 into 2 × 3 equal chunks; valid cp values for seq = 64 on 8 GPUs at tp = 2: "
        "1, 2, 4"),
    (8, "gpus = 8 is not divisible by tp × cp = 2 × 8; valid cp values for seq = 64 on 8 GPUs at tp = 2: 1, 2, 4"),
])
def test_bad_cp_refused(cp, message):
    with pytest.raises(ValueError) as raised:
        est.estimate(SHAPE, *est.job_of(cp=cp, **LAYOUT))
    assert str(raised.value) == message


def test_cp_needs_fused_attention_and_no_node_modes():
    with pytest.raises(ValueError, match=r"cp = 2 with attention = 'local' is invalid; context parallelism needs "
                                         r"attention = 'fused'"):
        est.estimate(SHAPE, *est.job_of(cp=2, **(LAYOUT | {"attention": "local"})))
    with pytest.raises(ValueError, match=r"cp = 2 with hpZ / hybrid sharding is invalid; valid: cp = 1"):
        est.estimate(SHAPE, *est.job_of(cp=2, stage=3, hybrid=True, dp_per_node=2, **LAYOUT))


def test_context_bytes_refusals():
    args = dict(seq=S, kv_width=GROUPS * D, layers=L, micro_batch=B, accumulation=1, tp=T, cp=2, act_bytes=E,
                recompute="full")
    with pytest.raises(ValueError, match=r"cp = 0 is invalid; must be an integer >= 1"):
        context_bytes_per_step(**(args | {"cp": 0}))
    with pytest.raises(ValueError, match=r"recompute = 'some' is invalid"):
        context_bytes_per_step(**(args | {"recompute": "some"}))


def test_memory_check_passes_the_context():
    """pretrain's start-up estimate passes parallel.context: 8 ranks at TP 2 × CP 2 is the estimator's cp = 2 on
    gpus = 8, and its accumulation counts DP = world ÷ (TP·PP·CP) ranks."""
    from pretrain.config import load_config
    from pretrain.memory_check import accumulation, attention_kind, estimate_config
    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=128", "model.num_attention_heads=4",
                             "model.seq_length=256", "model.recompute=full", "parallel.tensor=2", "parallel.context=2",
                             "zero.stage=3",
                             "train.global_batch_size=8"])
    m = cfg.model
    got = estimate_config(cfg, 8, 80 * est.GIB)
    want = est.estimate(m.shape, *est.job_of(gpus=8, tp=2, cp=2, stage=3, micro_batch=cfg.train.micro_batch_size,
                                             recompute=m.recompute, bucket_elements=cfg.zero.bucket_elements,
                                             precision=cfg.precision.dtype, prefetch_units=cfg.zero.prefetch_units,
                                             gpu_memory_bytes=80 * est.GIB, loss_chunk_tokens=m.loss_chunk_tokens,
                                             attention=attention_kind(m.attention),
                                             grad_shard_per_step=accumulation(cfg, 8) == 1))
    assert got == want
    e = est.PRECISIONS[cfg.precision.dtype].activation_bytes
    assert got.checkpoint_bytes == 2 * cfg.train.micro_batch_size * 128 * 128 * e  # L·b·(S/C)·h·e: 128 of 256 tokens
    assert accumulation(cfg, 8) == 8 // (cfg.train.micro_batch_size * 2)


LLAMA_128K = GPTShape(layers=32, hidden=4096, heads=32, query_groups=8, seq=131072, vocab=128256, ffn=14336,
                      mlp="swiglu", norm="rmsnorm", position_embedding="rope", bias=False)


def test_planner_proposes_the_smallest_context_that_fits():
    """The Llama-3 8B shape at 128K tokens with recomputation and megatron's loss (all S/C tokens' bf16 logits beside
    their fp32 copy: 100.9 GB at cp 1) on 8 × 8 H100 at TP 1, stage 3, global batch 64: the peak is the loss (every
    checkpoint, the logits, the final norm's tensors, the gathered output layer), which does not fit at cp 1 (149.0 GB
    with the margin), so the planner proposes cp 2 (dp 32, 2 micro-batches a step: 80.3 GB of 85.9), its memory the
    estimator's, and its step time adds the CP collectives: bytes / NVSwitch bandwidth + α per ring step
    (tp·cp = 2 ranks fit one node)."""
    from analysis.cluster import ClusterSpec
    from analysis.planner import plan
    cluster = ClusterSpec(preset="dgx-h100", nodes=8).cluster("bf16")
    found = plan(cluster, model=LLAMA_128K, global_batch=64, recompute="full", precision="bf16", attention="fused",
                 tp_choices=[1], stages=(3,), offload=False)
    assert found and {c.cp for c in found} == {2} and {c.dp for c in found} == {32}
    layout = dict(gpus=64, tp=1, stage=3, micro_batch=1, precision="bf16", attention="fused", recompute="full",
                  gpu_memory_bytes=cluster.gpu_memory_bytes)
    assert found[0].memory == est.estimate(LLAMA_128K, *est.job_of(cp=2, **layout))
    assert not est.estimate(LLAMA_128K, *est.job_of(cp=1, **layout)).fits
    # L·A·3 collectives (gather, reduce-scatter, the recomputed gather) · 2·S·b·g·d·e·(C−1)/C, A = 64/(1·32) = 2,
    # each C − 1 = 1 ring step
    sent = 32 * 2 * 3 * (2 * 131072 * 1 * 1024 * 2 * 1 / 2)
    steps = 32 * 2 * 3 * 1
    expected = sent / cluster.intra_node_bandwidth + steps * cluster.links.nvswitch_latency
    assert found[0].cp_s == pytest.approx(expected)


def test_planner_without_fused_attention_keeps_cp_one():
    """Local attention (the planner's default, the paper's Megatron) has no context parallelism."""
    from analysis.planner import plan
    found = plan(model=dataclasses.replace(SHAPE, layers=4), global_batch=16, gpus=8, precision="fp16")
    assert found and {c.cp for c in found} == {1}
