"""GPTModel's output layer and loss: the padded vocabulary never gets probability; the chunked loss fused.

Padded vocabulary. megatron pads the output layer to `model.padded_vocab_size(TP)` rows, the padding at the end of
the vocabulary (so on the last TP ranks' shards: at a small vocabulary and a large TP a whole shard can be padding).
Those rows are no token: their logits are set to −inf (`mask_padded_columns`) before any softmax, so they take no
probability and get no gradient, on every loss path, in evaluation, and in the logits the model returns without
labels (a `generate`-style argmax or sampling never picks one; the HF export drops the rows).

Loss paths (`model.loss_chunk_tokens` = c, `model.loss_recompute`):
- c = 0: megatron's: ColumnParallelLinear's [s, b, vocab/TP] logits into `vocab_parallel_cross_entropy`.
- c > 0 (default): `FusedLinearCrossEntropy`: output layer and vocab-parallel cross-entropy c tokens at a time, the
  gradients with respect to the hidden states, the weight and the bias computed in the forward pass (the softmax
  statistics all-reduced over TP per chunk, as megatron's cross-entropy does; the GEMMs in the model dtype, the
  softmax and the weight gradient's sum over chunks in fp32, added into by the GEMM itself where the device's can:
  `add_product`); backward only scales them. Neither the [tokens × vocab/TP] logits nor a second output GEMM exist. It
  holds from forward to backward the fp32 weight (and bias) gradient [vocab/TP, h] and the [tokens, h] hidden-state
  gradient (model dtype), each token's part weighted by its `loss_mask` (handed to the model's forward; none: every
  token 1). The weight gradient is a sum over tokens, so backward can only scale it by one number: the gradient
  reaching the per-token losses must be that loss mask times one number, as `pretrain.data.batch.token_mean` makes it
  (a mean, or a masked sum over a count; the loss scale and the division by micro-batches are that one number too).
  Anything else is refused in backward (an asynchronous check: no host read), naming model.loss_recompute.
- c > 0, `model.loss_recompute = true`: each chunk's output layer and cross-entropy under torch's non-reentrant
  checkpoint: nothing of the loss kept between forward and backward, one more output GEMM per step, any gradient.

The seam: `LossGPTModel` hands the labels (and loss mask) to its output layer (a `LossOutputLayer`, the same
ColumnParallelLinear with its parameters and hooks untouched) which then returns the per-token loss instead of
logits; megatron's `compute_language_model_loss` only transposes it. ZeRO stage 3's gather hooks on the output layer
hold its weight through the whole computation (the fused forward, or the recomputation in backward, which they
re-gather for); the weight's gradient reaches autograd once, in backward, as megatron's does.
"""
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import megatron_patches.lean  # noqa: F401  (megatron-core without its unused torch.compile/wandb set-up)
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region)

# The backward's gradient may differ from loss_mask × one number by this much (relative to its largest element):
# the float rounding of that product, far below any other gradient (a per-token weight differing by 1e-5).
PROPORTIONAL_TOLERANCE = 1e-5
# torch._assert_async's message: CUDA takes at most 254 characters (longer fails every step, whatever the condition)
NOT_PROPORTIONAL = ("fused loss: the per-token losses' gradient must be the loss_mask times one number (a mean or "
                    "masked mean); for any other function of them set model.loss_recompute = true")


def real_columns(real_vocab: int, width: int, first_id: int) -> int:
    """How many of a logits slice's `width` columns, holding token ids first_id.., are real tokens (< real_vocab);
    the rest, to its end, are megatron's padding."""
    return min(max(real_vocab - first_id, 0), width)


def mask_padded_columns(logits: torch.Tensor, columns: int) -> torch.Tensor:
    """`logits` [..., width] with its columns from `columns` on set to −inf, in place (no probability, no gradient)."""
    if columns < logits.shape[-1]:
        logits[..., columns:] = float("-inf")
    return logits


def _tp_all_reduce(tensor: torch.Tensor, op, tp_group) -> None:
    if tp_group is not None and tp_group.size() > 1:
        dist.all_reduce(tensor, op=op, group=tp_group)


def _target_columns(targets: torch.Tensor, first_id: int, width: int) -> tuple:
    """(each target's column in this rank's logits slice (0 where it is not there) [n], whether it is there [n])."""
    local = targets - first_id
    held = (local >= 0) & (local < width)
    return torch.where(held, local, 0), held


def _logits_and_max(hidden, weight, bias, columns: int, tp_group) -> tuple:
    """(one chunk's logits [n, width] in the model dtype, the padding at −inf; their max over every TP rank's columns
    [n], fp32)."""
    logits = torch.matmul(hidden, weight.t())
    if bias is not None:
        logits = logits + bias
    mask_padded_columns(logits, columns)
    top = logits.amax(dim=-1).float()  # the max of the model-dtype logits is that of their fp32 values
    _tp_all_reduce(top, dist.ReduceOp.MAX, tp_group)
    return logits, top


def _chunk_statistics(hidden, weight, bias, targets, columns: int, first_id: int, tp_group):
    """One chunk's vocab-parallel cross-entropy as megatron's `vocab_parallel_cross_entropy` computes it:
    (per-token loss [n], exp(logits − max) [n, width] fp32 (padding 0), the max-shifted sum of exps [n], the
    targets' local columns [n] and whether this rank holds them [n])."""
    logits, top = _logits_and_max(hidden, weight, bias, columns, tp_group)
    if logits.dtype == torch.float32:
        logits -= top.unsqueeze(-1)
    else:  # fp32 logits − max in one pass over the model-dtype ones (no separate fp32 copy pass)
        logits = torch.sub(logits, top.unsqueeze(-1))
    local, held = _target_columns(targets, first_id, logits.shape[-1])
    rows = torch.arange(logits.shape[0], device=logits.device)
    picked = torch.where(held, logits[rows, local], 0.0)
    logits.exp_()
    stats = torch.stack([logits.sum(dim=-1), picked])  # one all-reduce for both sums
    _tp_all_reduce(stats, dist.ReduceOp.SUM, tp_group)
    sum_exp, picked = stats[0], stats[1]
    return torch.log(sum_exp) - picked, logits, sum_exp, local, held


def _logits_gradient(exps, sum_exp, local, held, mask, dtype, d_bias):
    """d loss / d logits of one chunk in `dtype` (the GEMMs' operand, as megatron's backward): (softmax − one-hot) ×
    the token's mask, computed in fp32 from `exps` = exp(logits − max) (overwritten) and rounded once to `dtype`;
    `d_bias` (fp32), when given, gets its column sums. In a model dtype the softmax is written in `dtype` straight from
    the division (or the mask's product) and the targets' entries are set after, from their fp32 values: the same
    numbers as rounding the fp32 gradient, in two passes over the chunk fewer."""
    rows = torch.arange(exps.shape[0], device=exps.device)
    if dtype == torch.float32 or d_bias is not None:
        exps /= sum_exp.unsqueeze(-1)
        exps[rows, local] -= held.float()  # softmax − one-hot: d loss / d logits, this rank's columns
        if mask is not None:  # each token's share of the gradient backward will scale by one number
            exps *= mask.unsqueeze(-1)
        if d_bias is not None:
            d_bias += exps.sum(dim=0)
        return exps.to(dtype)
    out = torch.empty(exps.shape, dtype=dtype, device=exps.device)
    if mask is None:
        torch.div(exps, sum_exp.unsqueeze(-1), out=out)
        targets = exps[rows, local] / sum_exp - held.float()
    else:
        torch.mul(exps.div_(sum_exp.unsqueeze(-1)), mask.unsqueeze(-1), out=out)
        targets = (exps[rows, local] - held.float()) * mask
    out[rows, local] = targets.to(dtype)
    return out


def _softmax_sums(logits, top, local, held):
    """[Σ exp(logits − max), the target's logit − max (0 where another TP rank holds it)], fp32 [2, n], in one pass over
    the model-dtype logits: the first of the compiled kernels (`SoftmaxKernels`)."""
    shifted = logits.float() - top.unsqueeze(-1)
    picked = torch.where(held, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
    return torch.stack([shifted.exp().sum(dim=-1), picked])


def _softmax_gradient(logits, top, sum_exp, local, held, mask):
    """d loss / d logits = (softmax − one-hot) × the token's mask, in fp32 rounded once to the logits' dtype, from the
    model-dtype logits (the exponentials recomputed, never stored): the second compiled kernel (`SoftmaxKernels`)."""
    softmax = (logits.float() - top.unsqueeze(-1)).exp() / sum_exp.unsqueeze(-1)
    target = (torch.arange(logits.shape[-1], device=logits.device) == local.unsqueeze(-1)) & held.unsqueeze(-1)
    grad = softmax - target.float()
    if mask is not None:
        grad = grad * mask.unsqueeze(-1)
    return grad.to(logits.dtype)


class SoftmaxKernels(NamedTuple):
    """The fused loss's elementwise work on a chunk's bf16 / fp16 logits, compiled (model.compile, which sets them on
    the output layer): after the max, two passes over the logits (the sums; the gradient) where eager makes four (the
    max-shifted fp32 copy, exp, sum, division into the model dtype), and no fp32 [chunk, vocab/TP] tensor: the chunk
    holds its logits and their gradient, 4 bytes an element where eager holds 6. The TP all-reduces of the max and
    the sums stay eager, between them. Not for fp32 models: their eager path works in place on the logits (4 bytes),
    where these would hold a second fp32 tensor (8)."""
    sums: Callable
    gradient: Callable


def compiled_softmax(backend: str) -> SoftmaxKernels:
    return SoftmaxKernels(torch.compile(_softmax_sums, backend=backend),
                          torch.compile(_softmax_gradient, backend=backend))


def _compiled_chunk(hidden, weight, targets, columns: int, first_id: int, tp_group, mask, kernels: SoftmaxKernels,
                    needs_grad: bool):
    """(per-token loss [n], d loss / d logits in the model dtype or None) of one chunk without a bias, as
    `_chunk_statistics` and `_logits_gradient` compute them, through `kernels`."""
    logits, top = _logits_and_max(hidden, weight, None, columns, tp_group)
    local, held = _target_columns(targets, first_id, logits.shape[-1])
    sums = kernels.sums(logits, top, local, held)
    _tp_all_reduce(sums, dist.ReduceOp.SUM, tp_group)
    sum_exp, picked = sums[0], sums[1]
    return torch.log(sum_exp) - picked, kernels.gradient(logits, top, sum_exp, local, held, mask) if needs_grad else None


_FP32_ACCUMULATING_GEMM: dict = {}  # device -> does its GEMM add a half-precision product into fp32 itself


def fp32_accumulating_gemm(device: torch.device) -> bool:
    """Whether `torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)` adds a bf16 product into an fp32 `acc` in the
    GEMM itself on `device` (cuBLAS's β = 1 over an fp32 C: megatron's gradient_accumulation_fusion, without apex): a
    CUDA device whose torch passes `adds_unrounded`, asked once. Fake tensors (the probe) are never asked: False."""
    if device.type != "cuda" or torch._guards.detect_fake_mode() is not None:
        return False
    if device not in _FP32_ACCUMULATING_GEMM:
        _FP32_ACCUMULATING_GEMM[device] = adds_unrounded(device)
    return _FP32_ACCUMULATING_GEMM[device]


def adds_unrounded(device: torch.device) -> bool:
    """`fp32_accumulating_gemm`'s question, on real numbers: 1 + 2⁻²⁰ (an fp32 value bf16 cannot hold) plus the bf16
    product 1·3 + 2·4 must be 12 + 2⁻²⁰ to the bit; a torch that refuses the call (CPU in 2.13 has no such kernel,
    older CUDA builds want `acc` in the inputs' dtype), rounds `acc` or drops it answers False."""
    acc = torch.full((1, 1), 1 + 2.0 ** -20, dtype=torch.float32, device=device)
    a = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16, device=device)
    b = torch.tensor([[3.0], [4.0]], dtype=torch.bfloat16, device=device)
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return acc.item() == 12 + 2.0 ** -20


def add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32, [m, n]) += a · b for model-dtype a [m, k] and b [k, n]: where the device's GEMM accumulates in fp32
    (fp32_accumulating_gemm), by the GEMM itself — its fp32 product never rounded, no product tensor, no separate
    add; else the product in the model dtype (as megatron's GEMM), added in blocks of rows no larger than `a`, so no
    [m, n] product sits beside `acc`."""
    if fp32_accumulating_gemm(acc.device):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)  # acc += a · b, summed in fp32
        return
    rows_per_block = max(1, a.numel() // b.shape[1])
    for r in range(0, acc.shape[0], rows_per_block):
        acc[r:r + rows_per_block] += torch.matmul(a[r:r + rows_per_block], b)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Per-token loss [n] of hidden states [n, h] through `weight` [width, h] (and `bias`) against `targets` [n],
    `chunk` tokens at a time, with every gradient computed in forward (see the module docstring); the TP ranks'
    partial input gradients are summed by the caller's mapping (copy_to / gather_from_sequence_parallel_region)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, loss_mask, chunk: int, columns: int, first_id: int, tp_group,
                needs_grad: bool, kernels: Optional[SoftmaxKernels] = None):
        n = hidden.shape[0]
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        d_hidden = torch.empty_like(hidden) if needs_grad else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_grad else None
        d_bias = (torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                  if needs_grad and bias is not None else None)
        for start in range(0, n, chunk):
            part = slice(start, min(start + chunk, n))
            h = hidden[part]
            mask = None if loss_mask is None else loss_mask[part]
            if kernels is not None and bias is None:
                losses[part], grad_logits = _compiled_chunk(h, weight, targets[part], columns, first_id, tp_group,
                                                            mask, kernels, needs_grad)
            else:
                losses[part], softmax, sum_exp, local, held = _chunk_statistics(h, weight, bias, targets[part],
                                                                                columns, first_id, tp_group)
                grad_logits = (_logits_gradient(softmax, sum_exp, local, held, mask, weight.dtype, d_bias)
                               if needs_grad else None)
                del softmax  # (fp32: the same tensor) no fp32 copy beside the model-dtype one
            if not needs_grad:
                continue
            torch.matmul(grad_logits, weight, out=d_hidden[part])
            if weight.dtype == torch.float32:  # (addmm with out=, not addmm_: what torch's FLOP counter sees)
                torch.addmm(d_weight, grad_logits.t(), h, out=d_weight)
            else:
                add_product(d_weight, grad_logits.t(), h)
            del grad_logits  # freed before the next chunk's logits exist
        ctx.save_for_backward(d_hidden, d_weight, d_bias, loss_mask)
        ctx.dtypes, ctx.backward_ran = (hidden.dtype, weight.dtype), False
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        if ctx.backward_ran:
            raise RuntimeError("the fused loss's backward runs once (its stored gradients are scaled in place)")
        ctx.backward_ran = True
        d_hidden, d_weight, d_bias, loss_mask = ctx.saved_tensors
        scale = _scale_of(grad_losses.float(), loss_mask)
        hidden_dtype, weight_dtype = ctx.dtypes
        grad_hidden = d_hidden.float().mul_(scale).to(hidden_dtype) if ctx.needs_input_grad[0] else None
        grad_weight = d_weight.mul_(scale).to(weight_dtype) if ctx.needs_input_grad[1] else None
        grad_bias = d_bias.mul_(scale).to(weight_dtype) if d_bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None


def _scale_of(g: torch.Tensor, loss_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The one number c with g = c · loss_mask (loss_mask None: all 1), as a 0-d fp32 tensor; asserts (without a host
    read) that g is that, within PROPORTIONAL_TOLERANCE."""
    g = g.double()
    mask = torch.ones_like(g) if loss_mask is None else loss_mask.double()
    scale = (g * mask).sum() / (mask * mask).sum().clamp(min=torch.finfo(torch.float64).tiny)
    off = (g - scale * mask).abs().max()
    torch._assert_async(off <= PROPORTIONAL_TOLERANCE * g.abs().max(), NOT_PROPORTIONAL)
    return scale.float()


def _recomputed_chunk(hidden, weight, bias, targets, columns: int):
    logits = torch.matmul(hidden, weight.t())
    if bias is not None:
        logits = logits + bias
    mask_padded_columns(logits, columns)
    return tensor_parallel.vocab_parallel_cross_entropy(logits.unsqueeze(1), targets.unsqueeze(1)).squeeze(1)


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, bias, labels: torch.Tensor, chunk_tokens: int,
                 sequence_parallel: bool, tp_group, real_vocab: int, loss_mask: Optional[torch.Tensor] = None,
                 recompute: bool = False, kernels: Optional[SoftmaxKernels] = None) -> torch.Tensor:
    """Per-token loss [s, b] of hidden states [s (/TP under SP), b, h] through this TP rank's `weight`
    [vocab/TP, h] (and `bias`) against `labels` [s, b], over the first `real_vocab` token ids: fused
    (FusedLinearCrossEntropy; `loss_mask` [s, b] the per-token weights of its backward's gradient; `kernels` its
    compiled softmax, used without a bias) or with each chunk recomputed in backward (`recompute`)."""
    tp = tp_group.size() if tp_group is not None else 1
    if sequence_parallel and tp > 1:  # every TP rank needs the whole sequence (its backward: reduce-scatter)
        hidden = gather_from_sequence_parallel_region(hidden, group=tp_group)
    elif tp > 1:  # identity forward, input gradient summed over TP in backward
        hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    s, b, h = hidden.shape
    flat, targets = hidden.reshape(s * b, h), labels.reshape(s * b)
    width = weight.shape[0]
    first_id = (tp_group.rank() if tp > 1 else 0) * width
    columns = real_columns(real_vocab, width, first_id)
    if recompute:
        pieces = [torch.utils.checkpoint.checkpoint(_recomputed_chunk, flat[i:i + chunk_tokens], weight, bias,
                                                    targets[i:i + chunk_tokens], columns, use_reentrant=False)
                  for i in range(0, s * b, chunk_tokens)]
        return torch.cat(pieces).view(s, b)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (flat, weight, bias))
    mask = None if loss_mask is None else loss_mask.reshape(s * b).float()
    return FusedLinearCrossEntropy.apply(flat, weight, bias, targets, mask, chunk_tokens, columns, first_id,
                                         tp_group if tp > 1 else None, needs_grad, kernels).view(s, b)


class LossOutputLayer(ColumnParallelLinear):
    """GPTModel's output layer: its logits with the padded vocabulary at −inf; while `labels` is set and
    `chunk_tokens` > 0, (per-token loss [s, b], None) from `chunked_loss` instead of (logits, bias)."""
    labels = None
    loss_mask = None
    chunk_tokens = 0
    recompute = False
    real_vocab = 0
    kernels = None  # the fused loss's compiled softmax (SoftmaxKernels), set where model.compile compiles the layers

    def forward(self, input_, weight=None, runtime_gather_output=None):
        weight = self.weight if weight is None else weight
        if self.labels is None or not self.chunk_tokens:
            logits, bias = super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
            gathered = self.gather_output if runtime_gather_output is None else runtime_gather_output
            tp_rank = self.tp_group.rank() if self.tp_group is not None and not gathered else 0
            width = logits.shape[-1]
            return mask_padded_columns(logits, real_columns(self.real_vocab, width, tp_rank * width)), bias
        bias = self.bias if not self.skip_bias_add else None
        return chunked_loss(input_, weight, bias, self.labels, self.chunk_tokens, self.sequence_parallel,
                            self.tp_group, self.real_vocab, self.loss_mask, self.recompute, self.kernels), None


class LossGPTModel(GPTModel):
    """megatron's GPTModel over the padded vocabulary whose first `real_vocab` ids are tokens: its output layer a
    `LossOutputLayer` (padding at −inf); with `chunk_tokens` > 0 its loss (forward with labels) from `chunked_loss`,
    fused or, with `loss_recompute`, recomputed in backward. Its forward also takes the micro-batch's `loss_mask`
    [b, s]: the per-token weights of the gradient the fused loss will be given (pretrain.data.batch.token_mean)."""

    def __init__(self, *args, real_vocab: int, chunk_tokens: int = 0, loss_recompute: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        if not 0 < real_vocab <= self.vocab_size:
            raise ValueError(f"real_vocab = {real_vocab} is invalid; must be in 1..{self.vocab_size} (the padded vocabulary)")
        if chunk_tokens and self.config.mtp_num_layers is not None:
            raise ValueError("model.loss_chunk_tokens > 0 does not cover multi-token prediction; set it to 0")
        if self.post_process:
            # The constructed ColumnParallelLinear becomes its loss-computing subclass: same object,
            # parameters, tags and hooks (a subclass adding one forward branch and no state).
            self.output_layer.__class__ = LossOutputLayer
            self.output_layer.real_vocab = real_vocab
            self.output_layer.chunk_tokens = chunk_tokens
            self.output_layer.recompute = loss_recompute

    def forward(self, *args, labels=None, loss_mask=None, **kwargs):
        if labels is None or not self.post_process or not self.output_layer.chunk_tokens:
            return super().forward(*args, labels=labels, **kwargs)
        layer = self.output_layer
        layer.labels = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b], as megatron's loss
        layer.loss_mask = None if loss_mask is None else loss_mask.transpose(0, 1).contiguous()
        try:
            return super().forward(*args, labels=labels, **kwargs)
        finally:
            layer.labels = layer.loss_mask = None

    def compute_language_model_loss(self, labels, logits):
        """With the chunked loss `logits` is already the per-token loss [s, b] from the output layer: [b, s], as
        megatron returns."""
        if self.output_layer.labels is None:
            return super().compute_language_model_loss(labels, logits)
        return logits.transpose(0, 1).contiguous()
