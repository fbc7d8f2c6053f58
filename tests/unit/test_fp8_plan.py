"""The planner with precision.fp8 and zero.fp8_gather: the float8 GEMMs at the GPU's float8 peak, stage 3's float8
gathers in the α-β model, refusals where the GPU has no float8 (analysis/planner.py, comm_model.py)."""
import dataclasses
from fractions import Fraction

import pytest

from analysis.cluster import ClusterSpec
from analysis.comm_model import dp_collectives, link_bytes
from model_shape.gpt import GPTShape
from analysis.estimate import Step
from analysis.planner import ZeroChoice, layout_on, plan, step_time
from analysis.throughput import MEASURED_ROWS, KernelPath, PublishedShare
from analysis.modes import named_modes

LLAMA3_8B = GPTShape(layers=32, hidden=4096, heads=32, seq=8192, vocab=128256, ffn=14336, query_groups=8,
                     mlp="swiglu", norm="rmsnorm", position_embedding="rope", bias=False)
H100 = ClusterSpec(preset="dgx-h100", nodes=2).cluster("bf16")


def test_the_float8_gemms_run_at_the_float8_peak():
    """Llama-3 8B, 16 H100, stage 3, full recomputation: the layers' linear GEMMs (6 per token per weight, forward,
    recomputed forward and backward: 8 with the recomputation) at 1,979 TFLOP/s, the attention and logits at 989; both
    paths at one share of peak (a cluster with one row, which every path falls back to)."""
    cluster = dataclasses.replace(H100, rows=(PublishedShare("one row", "H100", KernelPath(), 0.3),))
    s, b, h, f, kv, layers, v = 8192, 128, 4096, 14336, 1024, 32, 128256
    linears = layers * 2 * (h * h + 2 * h * kv + h * h + 3 * h * f) * b * s  # one forward
    attention, logits = layers * 4 * s * h * b * s, 2 * h * v * b * s
    bf16, fp8 = (step_time(cluster, LLAMA3_8B, layout_on(H100, 16, 1), ZeroChoice(3), Step(2, "full", "bf16", float8=f),
                           b, LLAMA3_8B.params()) for f in ("none", "tensorwise"))
    rate = 16 * 0.3
    assert bf16["compute_s"] == pytest.approx((4 * (linears + attention) + 3 * logits) / (989e12 * rate))
    assert fp8["compute_s"] == pytest.approx((4 * attention + 3 * logits) / (989e12 * rate)
                                             + 4 * linears / (1979e12 * rate))
    assert 1.5 < bf16["compute_s"] / fp8["compute_s"] < 2


def test_fp8_gathers_send_one_byte_a_weight_element_and_the_amaxes():
    """Stage 3, N = 4 on one node, A = 2: each gather pass sends the float8 groups' E elements at one byte and the rest
    at two, and each of G groups all-reduces its W amaxes (4 bytes each) before each of the 2A gathers."""
    psi, e, w, g, n, a = 10_000, 6_000, 8, 2, 4, 2
    plain = sum(link_bytes(dp_collectives(3, "", psi, n, n, value_bytes=2, accumulation=a)))
    fp8 = sum(link_bytes(dp_collectives(3, "", psi, n, n, value_bytes=2, accumulation=a, float8_elements=e,
                                        float8_weights=w, float8_groups=g)))
    ring = Fraction(n - 1, n)
    assert plain - fp8 == 2 * a * e * ring - 2 * a * 2 * 4 * w * ring
    with pytest.raises(ValueError, match="float8 gathers run at stage 3 without hpZ or qwZ"):
        dp_collectives(3, "+hpZ", psi, n, 2, float8_elements=e)


def test_no_float8_on_an_a100_and_fp8_gather_layouts_have_no_hpz_or_qwz():
    a100 = ClusterSpec(preset="dgx-a100", nodes=2).cluster("bf16")
    args = dict(model=LLAMA3_8B, gpus=16, global_batch=128, recompute="full", precision="bf16")
    with pytest.raises(ValueError, match="float8 = 'tensorwise' needs float8 tensor cores; 2 DGX A100"):
        plan(a100, **args, float8="tensorwise")
    found = plan(H100, **args, float8="tensorwise", fp8_gather=True)
    modes = [named_modes(c.zero.zeropp) for c in found if c.zero.stage == 3]
    assert modes and not any(m.secondary_partition or m.weight_bits for m in modes)
    # timed at the share of peak the float8 rows measured (docs/gpu-check.md: 0.70× bf16 on the H200), not bf16's
    rows = [r.efficiency for r in MEASURED_ROWS if r.path.float8 == "tensorwise"]
    share = sum(rows) / len(rows)
    assert H100.efficiency_along(KernelPath.of(found[0].step)).value == share < 0.25
