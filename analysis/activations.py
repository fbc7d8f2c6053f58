"""What one transformer layer keeps for backward, in bytes on one TP rank, by the layer's shape (docs/estimator.md,
Activations): every activation, what selective recomputation keeps, and the MLP's share of them."""
from model_shape.gpt import GPTShape


def layer_bytes(shape: GPTShape, micro_batch: int, tp: int, act_bytes: int, attention_state: int,
                sequence_parallel: bool = False) -> int:
    """Activations one layer keeps for backward (Korthikanti et al. 2022), with `attention_state` the bytes core
    attention keeps beyond Q, K, V and its output (all heads).

    Whole on every rank: both norm inputs, the QKV and fc1 inputs (e each) and two 1-byte dropout masks.
    Split by TP: Q and the projection input (e·a·d each: e·h unless kv_channels sets d), K and V (e·g·d
    each), fc1's output (e·f, 2·e·f gated) and the activation's output (e·f); q/k norms keep their inputs too
    (e·(a·d + g·d)).
    GPT-2 at 2 bytes: s·b·h·(10 + 24/t + 5·a·s/(h·t)) with local attention.
    `sequence_parallel` (parallel.sequence_parallel): the whole part is each rank's s/t tokens too (the norms and
    dropouts run on a sequence slice, the QKV and fc1 GEMMs keep their input before its all-gather), so every term
    is ÷ t: s·b·h·34/t + 5·a·s²·b/t for GPT-2 (Korthikanti et al.'s equation 4)."""
    s, b, h, e = shape.seq, micro_batch, shape.hidden, act_bytes
    f, m = shape.ffn_size, 2 if shape.gated else 1
    whole = s * b * h * (4 * e + 2)
    q = shape.query_width
    split = s * b * e * (2 * q + 2 * shape.kv_width + f * m + f
                         + (q + shape.kv_width if shape.qk_layernorm else 0))
    if sequence_parallel:
        return (whole + split + attention_state) // tp
    return whole + (split + attention_state) // tp


def selective_layer_bytes(shape: GPTShape, micro_batch: int, tp: int, act_bytes: int, fused_attention: bool,
                          sequence_parallel: bool = False) -> int:
    """What one layer keeps under selective recomputation (pretrain/model/recompute.py), one TP rank: its input and
    its projection and fc2 GEMMs' outputs (e·h a token each, whole), its QKV and fc1 GEMMs' outputs (e·(a·d + 2·g·d)
    and e·f, 2·e·f gated, split by TP) and, with fused attention, its output and fp32 logsumexp (e·a·d and 4·a bytes
    a token, split); local attention's core is recomputed instead. `sequence_parallel`: the input is the rank's s/t
    tokens (÷ t), while the projection and fc2 outputs stay whole: what the GEMM makes, before its reduce-scatter
    (recomputed, not kept: recompute.py's KEPT_COLLECTIVES), is the [s, b, h] partial sum."""
    s, b, h, e, q = shape.seq, micro_batch, shape.hidden, act_bytes, shape.query_width
    f, m = shape.ffn_size, 2 if shape.gated else 1
    layer_input, gemm_outputs = s * b * h * e, 2 * s * b * h * e
    split = s * b * e * (q + 2 * shape.kv_width + f * m)
    if fused_attention:
        split += s * b * q * e + 4 * shape.heads * s * b
    if sequence_parallel:
        return gemm_outputs + (layer_input + split) // tp
    return layer_input + gemm_outputs + split // tp


def mlp_activation_bytes(shape: GPTShape, micro_batch: int, act_bytes: int) -> int:
    """fc1's output and the activation's output, all TP ranks: what the MLP's backward frees."""
    return shape.seq * micro_batch * shape.ffn_size * act_bytes * (3 if shape.gated else 2)
