"""The float8 recipes written out from their statement (docs/fp8.md; torchao's "tensorwise" and "rowwise"), for the
tests to hold pretrain/model/fp8.py and stage 3's float8 gather to: quantize each operand with its stated scale rule,
dequantize with the inverse scale, multiply in fp32, round once to bf16. Nothing here imports zero3d or pretrain."""
import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LARGEST = {E4M3: 448.0, E5M2: 57344.0}  # the formats' largest finite values (OCP FP8: e4m3fn 1.75·2⁸, e5m2 1.75·2¹⁵)


def scale_rule(amax: torch.Tensor, fmt, power_of_two: bool) -> torch.Tensor:
    """The recipes' scale: largest / amax (amax floored at 1e-12), divided in fp64, kept in fp32; rowwise rounds it
    down to a power of two."""
    scale = (LARGEST[fmt] / amax.double().clamp(min=1e-12)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_two else scale


def quantized(x: torch.Tensor, fmt, dim=None, power_of_two=False):
    """(x dequantized from its float8 codes, the codes): tensorwise (dim None) or one scale per slice along dim."""
    amax = x.float().abs().amax() if dim is None else x.float().abs().amax(dim=dim, keepdim=True)
    scale = scale_rule(amax, fmt, power_of_two)
    codes = (x.float() * scale).clamp(-LARGEST[fmt], LARGEST[fmt]).to(fmt)
    return codes.float() * scale.reciprocal(), codes


def reference(recipe: str, x, w, g):
    """(y, dx, dW, db) of y = x·Wᵀ + b, x [m, k], W [n, k], incoming gradient g [m, n], by the recipe."""
    if recipe == "tensorwise":  # one scale a tensor; e4m3 forward, e5m2 gradient
        xq, wq, gq = quantized(x, E4M3)[0], quantized(w, E4M3)[0], quantized(g, E5M2)[0]
        return ((xq @ wq.t()).bfloat16(), (gq @ wq).bfloat16(), (gq.t() @ xq).bfloat16(), g.sum(0))
    # rowwise: e4m3 throughout, power-of-two scales along each GEMM's contraction dimension
    y = (quantized(x, E4M3, 1, True)[0] @ quantized(w, E4M3, 1, True)[0].t()).bfloat16()  # contract over k
    dx = (quantized(g, E4M3, 1, True)[0] @ quantized(w, E4M3, 0, True)[0]).bfloat16()  # over n
    dw = (quantized(g, E4M3, 0, True)[0].t() @ quantized(x, E4M3, 0, True)[0]).bfloat16()  # over m
    return y, dx, dw, g.sum(0)


