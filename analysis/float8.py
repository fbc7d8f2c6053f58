"""What precision.fp8 and zero.fp8_gather add to a rank's memory (pretrain/model/fp8.py, zero3d/float8_gather.py): the
float8 codes and scales of fc2's backward, and stage 3's gathered units holding the layers' linear weights in float8
(docs/estimator.md, Float8; held to the probe by tests/unit/test_probe.py)."""
from model_shape.gpt import GPTShape

FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")  # pretrain's precision.fp8
SCALE_BYTES = 4  # an fp32 float8 scale


def float8_copy_bytes(shape: GPTShape, micro_batch: int, tp: int, float8: str, fp8_gather: bool = False,
                      cp: int = 1) -> int:
    """Bytes of float8 codes and scales an FP8 linear (pretrain/model/fp8.py) holds in fc2's backward, the moment the
    layers' activation gradients peak: with m = b·s/C tokens, h, f' = f/t, one byte a code,

    - tensorwise: the output gradient's codes and their transpose (2·m·h), the input's codes and their transpose
      (2·m·f'), the weight's codes (h·f'; none under zero.fp8_gather, whose gathered codes are the unit's), and three
      fp32 scalars (the output gradient's scale, two inverses; the input's and weight's scales are forward's, kept
      with the layer's activations);
    - rowwise: the output gradient per row, per column and that transposed (3·m·h), the input per column and
      transposed (2·m·f'), the weight per column (h·f'), their scale vectors (m + h + 2·f' fp32) and the weight
      gradient GEMM's inverse scales (h + f').

    The cast's fp32 staging (≤ zero3d.float8.CAST_CHUNK elements) is freed by then. The bf16 tensors autograd keeps
    are bf16 activations as without float8 (activations.layer_bytes)."""
    if float8 not in FLOAT8_RECIPES:
        raise ValueError(f"float8 = {float8!r} is invalid; valid: {', '.join(map(repr, FLOAT8_RECIPES))}")
    if float8 == "none":
        return 0
    m, h, f = micro_batch * shape.seq // cp, shape.hidden, shape.ffn_size // tp
    if float8 == "tensorwise":
        return 2 * m * h + 2 * m * f + (0 if fp8_gather else h * f) + 3 * SCALE_BYTES
    return 3 * m * h + 2 * m * f + h * f + SCALE_BYTES * (m + 2 * h + 3 * f)


def gathered_unit_bytes(shape: GPTShape, tp: int, param_bytes: int, fp8_gather: bool = False, dp: int = 1) -> int:
    """Bytes of stage 3's largest gather unit (a layer's or the embedding's TP slice) while gathered; under
    zero.fp8_gather a layer's QKV, projection, fc1 and fc2 weights are one byte an element, plus the 1/dp of them
    this rank cast for the gather (held until the unit is released)."""
    layer = shape.layer_params(tp) * param_bytes
    if fp8_gather:
        linears = shape.layer_linear_weights(tp)
        layer -= linears * (param_bytes - 1) - linears // dp
    return max(layer, shape.embedding_params(tp) * param_bytes)
