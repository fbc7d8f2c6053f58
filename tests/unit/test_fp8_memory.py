"""What precision.fp8 and zero.fp8_gather add to a rank's memory, in the estimator (analysis/float8.py) and as
the probe executes pretrain's own step on fake tensors: the planner's 13B stage 3 rank (tests/unit/test_probe.py's
H100_13B: 40 × 5120, micro-batch 16 × 1024 tokens, TP 1 × DP 32, bf16), 2 layers."""
import pytest

from pretrain.config import load_config
from pretrain.memory_check import estimate_config
from test_probe import H100_13B
from analysis.estimate import GIB

M, H, F = 16 * 1024, 5120, 4 * 5120  # tokens of a micro-batch, hidden, ffn


def _probe(extra: list):
    from pretrain.probe.rank import probe_rank
    cfg = load_config(None, H100_13B + ["model.num_layers=2"] + extra)
    return probe_rank(cfg, 32, 0, 1), estimate_config(cfg, 32, 80 * GIB)


@pytest.mark.one_core
def test_float8_codes_at_the_peak_are_the_estimators_and_fp8_gather_saves_what_it_says():
    """At the rank's peak (fc2's backward in the last layer) the temporaries are the estimator's buffer terms with
    "float8 copies" (bf16's gap: 153,600 B of 3.8 GB, 4e-5): tensorwise 2·m·h + 2·m·f + h·f codes and three fp32
    scalars, rowwise 3·m·h + 2·m·f + h·f codes and m + 2h + 3f fp32 scales (by hand below); the activations are
    bf16's (the FP8 linear keeps bf16 inputs), tensorwise with its forward's two fp32 scales a linear beside.
    zero.fp8_gather (a vocabulary of 8192, so that a layer stays the largest unit): two gathered layers hold their
    12h² linear weights at one byte, plus the 1/32 shard each cast, and fc2's backward casts no weight; the probe
    holds one of those cast shards among its activations, so the two categories together are compared."""
    bf16 = estimate_config(load_config(None, H100_13B + ["model.num_layers=2"]), 32, 80 * GIB)
    bf16_activations = 3_023_839_376  # the 13B rank's, probed (test_probe.py)
    runs = {recipe: _probe([f"precision.fp8={recipe}"]) for recipe in ("tensorwise", "rowwise")}
    assert runs["tensorwise"][1].buffer_bytes - bf16.buffer_bytes == 2 * M * H + 2 * M * F + H * F + 3 * 4
    assert runs["rowwise"][1].buffer_bytes - bf16.buffer_bytes == 3 * M * H + 2 * M * F + H * F + 4 * (M + 2 * H + 3 * F)
    for recipe, (run, estimate) in runs.items():
        assert run.peak_phase == "backward"
        assert run.peak_by_category["temporaries"] == pytest.approx(estimate.buffer_bytes, rel=1e-4)
        # tensorwise, the recomputed layer's four linears keep x's and W's forward scales for backward (fp32 each)
        kept_scales = 4 * 2 * 4 if recipe == "tensorwise" else 0
        assert run.peak_by_category["activations"] == bf16_activations + kept_scales
    small = ["precision.fp8=tensorwise", "model.vocab_size=8192"]
    gathered, estimate = _probe(small + ["zero.fp8_gather=true"])
    plain = estimate_config(load_config(None, H100_13B + ["model.num_layers=2"] + small), 32, 80 * GIB)
    assert plain.buffer_bytes - estimate.buffer_bytes == 2 * (12 * H * H - 12 * H * H // 32) + H * F
    held = gathered.peak_by_category["temporaries"] + gathered.peak_by_category["activations"]
    assert held == pytest.approx(estimate.buffer_bytes + bf16_activations, rel=1e-4)
