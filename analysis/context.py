"""Context parallelism in the estimator: its layout rules, each rank's S/C tokens, the gathered K and V."""
import dataclasses

from analysis.activations import mlp_activation_bytes
from analysis.modes import NODE_SPLITTING
from model_shape.gpt import GPTShape


def valid_context_sizes(seq: int, ranks: int) -> list:
    """The cp values that divide `ranks` (gpus ÷ tp) and split `seq` into 2·cp equal chunks (1 always: no split)."""
    return [c for c in range(1, ranks + 1) if c == 1 or (ranks % c == 0 and seq % (2 * c) == 0)]


def validate_context(cp, seq: int, gpus: int, tp: int, attention: str, node_aware: bool = False) -> None:
    """Raise ValueError naming the bad cp and what is valid: an integer >= 1, `seq` split into 2·cp equal chunks
    (pretrain/data/batch.py's context_chunks), gpus = tp × cp × dp, an attention that computes across the chunks
    (fused: megatron's local attention has none) and no node-aware ZeRO mode (pretrain/config.py refuses both)."""
    if type(cp) is not int or cp < 1:
        raise ValueError(f"cp = {cp!r} is invalid; must be an integer >= 1")
    if cp == 1:
        return
    valid = ", ".join(map(str, valid_context_sizes(seq, gpus // tp)))
    if seq % (2 * cp):
        raise ValueError(f"cp = {cp} does not split seq = {seq} into 2 × {cp} equal chunks; valid cp values for "
                         f"seq = {seq} on {gpus} GPUs at tp = {tp}: {valid}")
    if gpus % (tp * cp):
        raise ValueError(f"gpus = {gpus} is not divisible by tp × cp = {tp} × {cp}; valid cp values for seq = {seq} "
                         f"on {gpus} GPUs at tp = {tp}: {valid}")
    if attention != "fused":
        raise ValueError(f"cp = {cp} with attention = {attention!r} is invalid; context parallelism needs "
                         "attention = 'fused' (megatron's local attention has none)")
    if node_aware:
        raise ValueError(f"cp = {cp} with {NODE_SPLITTING} sharding is invalid; valid: cp = 1 (their node groups are "
                         "built over the data-parallel ranks alone)")


def local_shape(shape: GPTShape, cp: int) -> GPTShape:
    """The shape as one CP rank's activations see it: S/C tokens a sequence (its parameters stay `shape`'s: the
    learned position embedding holds all S positions)."""
    return shape if cp == 1 else dataclasses.replace(shape, seq=shape.seq // cp)


def gathered_kv_bytes(shape: GPTShape, micro_batch: int, tp: int, cp: int, act_bytes: int) -> int:
    """K and V as pretrain/model/context.py's attention keeps them for backward, beyond the S/C tokens' K and V
    that activations.layer_bytes counts, on a TP rank: each layer all-gathers K and V ([S, b, g, d] each)
    over the CP group, and each local chunk's SDPA call keeps its key prefix of them (views of the gathered
    tensors, unrepeated: enable_gqa; its causal mask is the kernels' own, lower-right aligned, no tensor), so
    the other ranks' S − s tokens of K and V are kept too: 2·e·b·(S − s)·g·d/t, s = S/C (g·d: the K width over
    all TP ranks)."""
    s, b, e = shape.seq // cp, micro_batch, act_bytes
    return 2 * e * b * (shape.seq - s) * shape.kv_width // tp if cp > 1 else 0


def context_backward_bytes(shape: GPTShape, micro_batch: int, tp: int, cp: int, act_bytes: int) -> int:
    """Activation gradients alive while a context-parallel layer's attention back-propagates: the gradients of
    the gathered K and V (2·e·S·b·g·d/t, reduce-scattered after), of Q and of the attention's output
    (2·e·s·b·a·d/t: a·d = h unless the shape sets its head size), less the MLP activations the layer's backward
    has freed by then (estimate.backward_transient_bytes takes the larger of this and fc2's moment)."""
    if cp == 1:
        return 0
    s, b, e, q = shape.seq // cp, micro_batch, act_bytes, shape.query_width
    return (2 * e * shape.seq * b * shape.kv_width + 2 * e * s * b * q
            - mlp_activation_bytes(local_shape(shape, cp), b, e)) // tp


def context_layer_bytes(shape: GPTShape, micro_batch: int, tp: int, cp: int, act_bytes: int) -> int:
    """What context parallelism adds to one layer's activations at S/C tokens: the other ranks' K and V
    (gathered_kv_bytes; 0 at cp = 1)."""
    return gathered_kv_bytes(shape, micro_batch, tp, cp, act_bytes)
