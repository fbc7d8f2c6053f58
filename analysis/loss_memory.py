"""What the loss holds on a rank (pretrain/model/loss.py): its logits, a chunk or all of them, and the fused loss's
gradients kept from its forward to its backward."""
from model_shape.gpt import GPTShape


def loss_logit_bytes(activation_bytes: int, fused: bool, compiled: bool) -> int:
    """Bytes a logit of the loss holds at its peak (pretrain/model/loss.py; measured: tests/unit/test_fused_loss.py,
    bench/bench_loss.py): an fp32 model's logits are worked on in place (4); a half-precision model's are held beside
    their fp32 copy, the softmax's input, then its fp32 exps beside their gradient in the model dtype (e + 4) — on
    every path but the `fused` one with `compiled` layers, whose softmax kernels (loss.SoftmaxKernels) hold only the
    logits and their gradient (2e)."""
    if activation_bytes == 4:
        return 4
    return 2 * activation_bytes if fused and compiled else activation_bytes + 4


def loss_bytes(shape: GPTShape, tokens: int, tp: int, activation_bytes: int, chunk_tokens: int = 0,
               recompute: bool = False, beside: float = 0.0, compiled: bool = False) -> float:
    """What the loss of `tokens` tokens adds to the rank's peak on one TP rank (pretrain/model/loss.py): the logits of
    the rank's padded vocabulary slice (loss_logit_bytes a logit) for all tokens (`chunk_tokens` 0, megatron's) or one
    chunk; the fused chunked loss (not `recompute`) also keeps its fp32 output-weight gradient [V/t, h] and the
    hidden-state gradient [tokens, h] (activation dtype) from its forward to its backward, a moment at which the
    `beside` bytes counted elsewhere (the buffers, a recomputed layer) are not in use: only what it holds beyond them
    is added. `compiled`: model.compile compiles the layers (and so the fused loss's softmax)."""
    width = shape.padded_vocab(tp) // tp
    fused = bool(chunk_tokens) and not recompute
    per_logit = loss_logit_bytes(activation_bytes, fused, compiled)
    if not chunk_tokens:
        return float(tokens * width * per_logit)
    stored = width * shape.hidden * 4 + tokens * shape.hidden * activation_bytes if fused else 0
    return min(tokens, chunk_tokens) * width * per_logit + max(0.0, stored - beside)
