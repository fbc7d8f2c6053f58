"""Float8 arithmetic of the two dynamic current-scaling training recipes, tensorwise and rowwise (torchao 0.18's)."""
from dataclasses import dataclass
from typing import Optional

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
AMAX_FLOOR = 1e-12  # torchao's EPS: an all-zero tensor gets scale max / 1e-12, not a division by zero
# Elements a cast stages in fp32 at once (256 MiB): a larger operand is cast in row blocks, so the fp32 copy a cast
# needs never exceeds this (a 13B layer's fc2 input at micro-batch 16 is 335M elements: 2.7 GB in two fp32 copies)
CAST_CHUNK = 1 << 26
FLOAT8_WEIGHT = "float8_weight"  # parameter attribute: a weight the FP8 linear layers cast (stage 3 may gather it so)
FLOAT8_GATHERED = "float8_gathered"  # parameter attribute while stage 3 holds it gathered as float8: a Float8Weight


@dataclass(frozen=True)
class Float8Recipe:
    """How one recipe scales and casts: the granularity, the gradient's format, the scale rounding."""

    name: str
    rowwise: bool  # one scale per row / column along the contraction dimension; False: one per tensor
    grad_dtype: torch.dtype  # the output gradient's float8 format (input and weight: e4m3)
    power_of_two_scales: bool  # each scale rounded down to a power of two

    @property
    def casts_grad_as(self) -> str:
        return "e5m2" if self.grad_dtype == E5M2 else "e4m3"


RECIPES = {"tensorwise": Float8Recipe("tensorwise", rowwise=False, grad_dtype=E5M2, power_of_two_scales=False),
           "rowwise": Float8Recipe("rowwise", rowwise=True, grad_dtype=E4M3, power_of_two_scales=True)}


@dataclass(frozen=True)
class Float8Weight:
    """A weight already in float8 (stage 3's float8 gather): its e4m3 codes and the scale they were cast with
    (codes = saturate(weight · scale)); the FP8 linear layers use it instead of casting the weight themselves."""

    codes: torch.Tensor
    scale: torch.Tensor  # fp32, one element


def scale_from_amax(amax: torch.Tensor, dtype: torch.dtype, power_of_two: bool = False) -> torch.Tensor:
    """The cast's scale(s), fp32: the format's largest value / max(amax, AMAX_FLOOR), divided in fp64 (torchao: the
    same value eager and compiled), optionally rounded down to a power of two."""
    scale = (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=AMAX_FLOOR)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_two else scale


def cast(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
    """Float8 codes of x · scale (in fp32), saturated to the format's range (torch's own cast does not saturate). The
    product is staged in one fp32 copy, in place; a 2-D x of more than CAST_CHUNK elements a block of rows at a time
    (`scale`: one element, (1, n), or (m, 1) sliced with the rows). Compiled, the cast is one kernel that stages
    nothing, so it is never blocked: the blocks' writes would put float8 constants in it (the fill of `out`, masked
    zeros), which Triton cannot build (`no attribute 'get_fp8e5'` on an H200, docs/gpu-check.md)."""
    top = torch.finfo(dtype).max
    if x.numel() <= CAST_CHUNK or x.dim() != 2 or torch.compiler.is_compiling():
        staged = x.to(torch.float32, copy=True)
        return staged.mul_(scale).clamp_(min=-top, max=top).to(dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    rows = max(1, CAST_CHUNK // x.shape[1])
    per_row = scale.dim() == 2 and scale.shape[0] > 1
    for i in range(0, x.shape[0], rows):
        out[i:i + rows] = cast(x[i:i + rows], dtype, scale[i:i + rows] if per_row else scale)
    return out


def quantize(x: torch.Tensor, dtype: torch.dtype, power_of_two: bool = False,
             dim: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) of a 2-D tensor: one scale over the whole tensor (`dim` None), or one per slice along `dim`
    (dim = 1: a scale per row, shape (m, 1); dim = 0: a scale per column, shape (1, n))."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=dim, keepdim=dim is not None)  # max |x|, no |x| copy
    scale = scale_from_amax(amax, dtype, power_of_two)
    return cast(x, dtype, scale), scale
