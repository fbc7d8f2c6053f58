"""bench/fp8_ceiling.py: the linear GEMMs an FP8 step runs in float8 (each layer's four weights, by hand), the ceiling
their times set on an FP8 row's speed-up (T / (T − L_bf16 + L_fp8), by hand), and the share of it a row reached."""
from pathlib import Path

import pytest
import torch

from bench import fp8_ceiling as ceiling

TINY_LLAMA = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_llama.toml")

LLAMA = dict(kind="llama", layers=2, hidden=64, heads=4, query_groups=2, ffn=160, seq=32, micro=2)
GPT = dict(kind="gpt", layers=3, hidden=64, heads=4, seq=32, micro=2)


def test_each_layers_four_linear_weights():
    # Llama: Q (4 heads × 16) and K, V (2 groups × 16) fused, the projection, gate and up fused, down
    assert ceiling.linear_shapes(LLAMA) == [(64, 64 + 2 * 32), (64, 64), (64, 2 * 160), (160, 64)]
    # GPT: QKV 3h, projection, fc1 4h, fc2
    assert ceiling.linear_shapes(GPT) == [(64, 192), (64, 64), (64, 256), (256, 64)]


def test_the_ceiling_is_the_bf16_step_with_the_linears_gemms_in_float8_instead(monkeypatch):
    times = {(64, 192): (4e-3, 2e-3), (64, 64): (1e-3, 1e-3), (64, 256): (5e-3, 2e-3), (256, 64): (6e-3, 3e-3)}
    monkeypatch.setattr(ceiling, "layer_gemm_seconds",
                        lambda tokens, d_in, d_out, recipe, device, repeats: times[(d_in, d_out)])
    got = ceiling.fp8_ceiling(GPT, "tensorwise", 0.1, torch.device("cpu"))
    assert got["linears_bf16_s"] == pytest.approx(3 * 16e-3) and got["linears_fp8_s"] == pytest.approx(3 * 8e-3)
    assert got["ceiling"] == pytest.approx(0.1 / (0.1 - 0.048 + 0.024))  # 1.316×
    twice = ceiling.fp8_ceiling(dict(GPT, micro_batches=2), "tensorwise", 0.1, torch.device("cpu"))
    assert twice["linears_bf16_s"] == pytest.approx(2 * 3 * 16e-3)  # every micro-batch of the step runs them
    table = ceiling.ceiling_table([got], {"tensorwise": 0.09}, "zero3d GPT (compiled, stage 2)")
    measured = 0.1 / 0.09
    assert (f"| tensorwise | 48.0 | 24.0 | 2.00× | {got['ceiling']:.3f}× | {measured:.3f}× | "
            f"{(measured - 1) / (got['ceiling'] - 1):.0%} |") in table


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_float8_gemms_timed_are_the_fp8_linears(recipe):
    """The GEMMs the ceiling times in float8 are the FP8 linear's own: scaled_matmul over float8_operands gives, to the
    bit, pretrain/model/fp8.py's forward output and its input and weight gradients (CPU runs torch._scaled_mm), with
    the fast accumulation on the forward GEMM only; and both timings are measured."""
    from pretrain.model.fp8 import backward_gemms, forward_gemm, scaled_matmul
    from zero3d.float8 import RECIPES

    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(*size, generator=g).bfloat16() for size in ((32, 48), (80, 48), (32, 80)))
    y, scales = forward_gemm(x, w, RECIPES[recipe])
    dx, dw = backward_gemms(dy, x, w, RECIPES[recipe], scales)
    operands = ceiling.float8_operands(x, w, dy, recipe)
    assert [fast for _, _, fast in operands] == [True, False, False]
    for name, (a, b, fast), expected in zip(("y", "dx", "dW"), operands, (y, dx, dw)):
        assert torch.equal(scaled_matmul(*a, *b, torch.bfloat16, fast_accum=fast), expected), name
    bf16, fp8 = ceiling.layer_gemm_seconds(32, 48, 80, recipe, torch.device("cpu"), repeats=1)
    assert bf16 > 0 and fp8 > 0


def test_a_configs_rank_runs_its_tp_slices_linears_for_each_micro_batch(capsys):
    """configs/tiny_llama.toml (TP 2 on 4 GPUs: DP 2, micro-batch 4 of a global 16, so 2 micro-batches a step): its
    rank's linears are the TP slices (QKV 128 + 2·64 wide and fc1 2·352 split by output, the projection and fc2 by
    input), and the command prints a ceiling row per recipe asked for, the FP8 run's measured ratio beside it."""
    from pretrain.config import load_config
    shape = ceiling.config_shape(load_config(TINY_LLAMA, []))
    assert (shape["layers"], shape["micro"], shape["seq"], shape["micro_batches"]) == (4, 4, 128, 2)
    assert ceiling.linear_shapes(shape) == [(128, 128), (64, 128), (128, 352), (176, 128)]
    assert ceiling.main(["--config", TINY_LLAMA, "--bf16-step-s", "100", "--recipe", "tensorwise",
                         "--fp8-step-s", "tensorwise=80", "--device", "cpu"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tensorwise |")]
    assert len(lines) == 1 and "| 1.250× |" in lines[0]
    with pytest.raises(SystemExit):
        ceiling.main(["--config", TINY_LLAMA, "--bf16-step-s", "1", "--fp8-step-s", "tensorwise=0"])
    assert "--fp8-step-s 'tensorwise=0' is invalid; give RECIPE=SECONDS" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a config that is not there: one line, no traceback
        ceiling.main(["--config", "no/such.toml", "--bf16-step-s", "1"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python bench/fp8_ceiling.py: error: config file 'no/such.toml' does not exist")
