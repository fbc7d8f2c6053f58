"""precision.fp8: the transformer layers' four GEMMs (QKV, projection, fc1, fc2) in float8, through megatron's layer
spec: `float8_layer` points its linear submodules at subclasses of ColumnParallelLinear / RowParallelLinear whose
matmul is `Float8LinearFunction` (zero3d/float8.py's recipes, docs/fp8.md); the output layer, norms, attention
core and loss stay in bf16, the masters and optimizer as they are.

The function does what megatron's LinearWithGradAccumulationAndAsyncCommunication does around its matmuls — under
sequence parallelism the input all-gathered over TP in forward and again in backward, the input gradient
reduce-scattered (or, column-parallel without SP, all-reduced) — with each matmul in float8:

  forward      y  = x · Wᵀ        x, W in e4m3
  input grad   dx = dy · W        dy in e5m2 (tensorwise) / e4m3 (rowwise), W in e4m3
  weight grad  dW = dyᵀ · x       dy as above, x in e4m3

each operand cast with its own current scale (tensorwise: the tensor's amax; rowwise: per row or column along the
GEMM's contraction dimension, so the backward GEMMs re-quantize dy, W and x along their other axis; tensorwise, x
and W are cast again in backward with their forward scales, kept as two fp32 scalars). It keeps the
bf16 input and the weight parameter for backward, as megatron's does (and torchao's recipes): activations cost
what bf16 costs, and at ZeRO stage 3 the weight is gathered again in backward, not held in float8 between. Each TP
rank scales its own slice (no amax collective over TP): a TP 2 run is not TP 1's to bf16 rounding, they differ by
float8 rounding (docs/fp8.md, Tensor parallelism).
"""
import functools
from typing import Optional

import torch
import torch.distributed as dist

from pretrain.errors import ConfigError
from zero3d.comm.core import all_gather_single, reduce_scatter_single
from zero3d.float8 import (E4M3, FLOAT8_GATHERED, FLOAT8_WEIGHT, RECIPES, Float8Recipe, cast, quantize,
                           scale_from_amax)


def scaled_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                  out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """a @ bᵀ dequantized, for float8 `a` [m, k] and `b` [n, k], each contiguous along k, cast with `a_scale`
    (one element, or (m, 1)) and `b_scale` (one element, or (n, 1)); out_dtype [m, n]."""
    if a_scale.numel() == 1:
        return torch._scaled_mm(a, b.t(), a_scale.reciprocal().reshape(()), b_scale.reciprocal().reshape(()),
                                out_dtype=out_dtype, use_fast_accum=fast_accum)
    return torch._scaled_mm(a, b.t(), a_scale.reciprocal().reshape(-1, 1).contiguous(),
                            b_scale.reciprocal().reshape(1, -1).contiguous(), out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def unavailable(device: torch.device) -> Optional[str]:
    """Why float8 matmuls cannot run on `device` (None when they can): torch without float8 dtypes or
    `_scaled_mm`, or a CUDA GPU below compute capability 8.9 (Ada, Hopper and newer have float8 tensor cores)."""
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no float8 dtypes or torch._scaled_mm"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return (f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; float8 "
                    "matmuls need 8.9 or newer (Ada, Hopper, Blackwell)")
    return None


def weight_in_float8(weight: torch.Tensor, scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, scale) of a weight, tensorwise: stage 3's float8 gather when it holds one (zero.fp8_gather: the
    codes and scale every DP rank cast its shard with), else the weight cast here, with `scale` when given (the
    forward's, in backward: the same weight, so the same amax)."""
    gathered = getattr(weight, FLOAT8_GATHERED, None)
    if gathered is not None:
        return gathered.codes, gathered.scale
    if scale is None:
        scale = scale_from_amax(torch.linalg.vector_norm(weight, ord=float("inf")), E4M3)  # its amax now
    return cast(weight, E4M3, scale), scale


def forward_gemm(x: torch.Tensor, weight: torch.Tensor,
                 recipe: Float8Recipe) -> tuple[torch.Tensor, Optional[tuple[torch.Tensor, torch.Tensor]]]:
    """(y = x · Wᵀ, tensorwise: the scales of x and W) for x [m, k] and W [n, k], both in e4m3 (rowwise: x per row,
    W per output row; its backward scales other axes, so no scales are returned)."""
    if recipe.rowwise:
        pow2 = recipe.power_of_two_scales
        (x8, x_scale), (w8, w_scale) = quantize(x, E4M3, pow2, dim=1), quantize(weight, E4M3, pow2, dim=1)
    else:
        (x8, x_scale), (w8, w_scale) = quantize(x, E4M3), weight_in_float8(weight)
    y = scaled_matmul(x8, x_scale, w8, w_scale, x.dtype, fast_accum=True)
    return y, None if recipe.rowwise else (x_scale, w_scale)


def backward_gemms(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe,
                   scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx = dy · W, dW = dyᵀ · x) for dy [m, n], x [m, k], W [n, k]; each GEMM's operands contiguous along its
    contraction dimension (n for dx, m for dW), so the float8 codes are transposed where needed (one byte each).
    Tensorwise, `scales` are the forward's (x's and W's: the same tensors, so the same amax): x and W are cast with
    them, with no second pass to find their amax; only dy's is taken here."""
    if recipe.rowwise:  # each operand re-quantized along the contraction dimension of the GEMM it enters
        fmt, pow2 = recipe.grad_dtype, recipe.power_of_two_scales
        g_rows, g_rows_scale = quantize(grad, fmt, pow2, dim=1)  # (m, 1)
        w_cols, w_cols_scale = quantize(weight, E4M3, pow2, dim=0)  # (1, k)
        g_cols, g_cols_scale = quantize(grad, fmt, pow2, dim=0)  # (1, n)
        x_cols, x_cols_scale = quantize(x, E4M3, pow2, dim=0)  # (1, k)
        dx = scaled_matmul(g_rows, g_rows_scale, w_cols.t().contiguous(), w_cols_scale.t(), grad.dtype)
        dw = scaled_matmul(g_cols.t().contiguous(), g_cols_scale.t(), x_cols.t().contiguous(), x_cols_scale.t(),
                           weight.dtype)
        return dx, dw
    g8, g_scale = quantize(grad, recipe.grad_dtype)  # one scale: the transposed codes are the transpose's codes
    x_scale, w_scale = scales if scales is not None else (None, None)
    w8, w_scale = weight_in_float8(weight, w_scale)
    x8, x_scale = quantize(x, E4M3) if x_scale is None else (cast(x, E4M3, x_scale), x_scale)
    dx = scaled_matmul(g8, g_scale, w8.t().contiguous(), w_scale, grad.dtype)
    dw = scaled_matmul(g8.t().contiguous(), g_scale, x8.t().contiguous(), x_scale, weight.dtype)
    return dx, dw


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Sequence parallelism: the [s/t, b, h] slices of the TP group concatenated along the sequence."""
    out = torch.empty((x.shape[0] * dist.get_world_size(group), *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(output_tensor=out, input_tensor=x.contiguous(), group=group)
    return out


class Float8LinearFunction(torch.autograd.Function):
    """megatron's linear function (TP communication, bias) with its three matmuls in float8 (module docstring)."""

    @staticmethod
    def forward(ctx, input, weight, bias, recipe: Float8Recipe, allreduce_dgrad: bool, sequence_parallel: bool,
                tp_group):
        ctx.recipe, ctx.allreduce_dgrad, ctx.sequence_parallel, ctx.tp_group = (recipe, allreduce_dgrad,
                                                                                 sequence_parallel, tp_group)
        ctx.use_bias = bias is not None
        total = _gather_sequence(input, tp_group) if sequence_parallel else input
        out, scales = forward_gemm(total.reshape(-1, total.shape[-1]), weight, recipe)
        ctx.save_for_backward(input, weight, *(scales or ()))  # tensorwise: x's and W's scales, one element each
        out = out.view(*total.shape[:-1], out.shape[-1])
        return out + bias if bias is not None else out

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, *scales = ctx.saved_tensors
        total = _gather_sequence(input, ctx.tp_group) if ctx.sequence_parallel else input
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        dx, dw = backward_gemms(grad, total.reshape(-1, total.shape[-1]), weight, ctx.recipe, tuple(scales) or None)
        dx = dx.view(*total.shape[:-1], dx.shape[-1])
        if ctx.sequence_parallel:  # each TP rank keeps its sequence slice of the summed input gradient
            piece = torch.empty(input.shape, dtype=dx.dtype, device=dx.device)
            reduce_scatter_single(output=piece, input=dx.contiguous(), group=ctx.tp_group)
            dx = piece
        elif ctx.allreduce_dgrad:
            dist.all_reduce(dx, group=ctx.tp_group)
        grad_bias = grad.sum(dim=0) if ctx.use_bias else None
        return dx, dw, grad_bias, None, None, None, None


def _check_plain(gradient_accumulation_fusion: bool, grad_output_buffer) -> None:
    """The megatron options this function does not implement are off in every config zero3d builds."""
    if gradient_accumulation_fusion or grad_output_buffer is not None:
        raise ValueError("the FP8 linear layers implement neither gradient_accumulation_fusion nor deferred "
                         "weight-gradient buffers (both off in zero3d's TransformerConfig)")


class _Float8Matmul:
    """What both float8 linear classes change in megatron's: the weight marked for ZeRO's float8 gathers, and the
    matmul of `_forward_impl` in float8 (`recipe`: zero3d.float8.RECIPES); megatron's forward around it unchanged."""

    def __init__(self, *args, recipe: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.recipe = RECIPES[recipe]
        setattr(self.weight, FLOAT8_WEIGHT, True)

    def _forward_impl(self, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                      grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None):
        _check_plain(gradient_accumulation_fusion, grad_output_buffer)
        return Float8LinearFunction.apply(input, weight, bias, self.recipe, allreduce_dgrad, sequence_parallel,
                                          tp_group)


@functools.cache
def _column_parallel_class():
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class Float8ColumnParallelLinear(_Float8Matmul, ColumnParallelLinear):
        """megatron's ColumnParallelLinear (QKV, fc1) with its matmul in float8."""

    return Float8ColumnParallelLinear


@functools.cache
def _row_parallel_class():
    from megatron.core.tensor_parallel import RowParallelLinear

    class Float8RowParallelLinear(_Float8Matmul, RowParallelLinear):
        """megatron's RowParallelLinear (projection, fc2) with its matmul in float8; its output is summed (or
        reduce-scattered under SP) over TP by megatron's forward, in bf16, as before."""

    return Float8RowParallelLinear


def float8_layer(layer, recipe: str):
    """A transformer layer's ModuleSpec with its QKV, projection, fc1 and fc2 built as the float8 linear classes."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    column = ModuleSpec(module=_column_parallel_class(), params={"recipe": recipe})
    row = ModuleSpec(module=_row_parallel_class(), params={"recipe": recipe})
    attention, mlp = layer.submodules.self_attention, layer.submodules.mlp
    attention = dataclasses.replace(attention, submodules=dataclasses.replace(
        attention.submodules, linear_qkv=column, linear_proj=row))
    mlp = dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, linear_fc1=column, linear_fc2=row))
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention,
                                                                     mlp=mlp))


def check_float8_device(fp8: str, device: torch.device) -> None:
    """precision.fp8 on a device without float8 matmuls: one line (ConfigError), before the model is built."""
    why: Optional[str] = unavailable(device) if fp8 != "none" else None
    if why:
        raise ConfigError(f"precision.fp8 = {fp8!r} cannot run here: {why}", fix='use precision.fp8 = "none"')
