"""`python -m analysis`: every flag is honoured or refused (--json with --largest / --plan, --dp with a shape)."""
import json

import pytest

from analysis.__main__ import main

SHAPE = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "512", "--seq", "64", "--stage", "2"]


def test_largest_honours_json(capsys):
    """ZeRO-Offload's anchor (docs/estimator.md): 71 layers × 4096 on one 32 GB V100."""
    assert main(["--largest", "--stage", "2", "--gpus", "1", "--offload-optimizer", "cpu", "--recompute", "full",
                 "--bucket-elements", "50000000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    L, h, V, s = out["layers"], out["hidden"], 50304, 1024  # 50257 padded to a multiple of 128
    assert (L, h) == (71, 4096)
    assert out["params"] == L * (12 * h * h + 13 * h) + 2 * h + 2 * V * h + s * h
    assert out["device"]["fits"] and out["device"]["total_bytes"] <= 32 * 2**30  # margin included


@pytest.mark.parametrize("plan", ["paper", "csv", "rank"])
def test_plan_refuses_json(plan, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--plan", plan, "--json"])
    assert exit_.value.code == 2 and f"--json is not available with --plan {plan}" in capsys.readouterr().err


def test_dp_in_shape_mode_gives_the_gpus(capsys):
    assert main(SHAPE + ["--tp", "2", "--dp", "4", "--json"]) == 0
    with_dp = json.loads(capsys.readouterr().out)
    assert main(SHAPE + ["--tp", "2", "--gpus", "8", "--json"]) == 0
    assert with_dp == json.loads(capsys.readouterr().out)
    assert main(SHAPE + ["--tp", "2", "--gpus", "2", "--json"]) == 0  # dp 1: another answer
    assert with_dp != json.loads(capsys.readouterr().out)


def test_dp_disagreeing_with_gpus_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(SHAPE + ["--gpus", "8", "--dp", "2"])
    assert exit_.value.code == 2 and "--dp 2 disagrees with --gpus 8 / --tp 1 = 8" in capsys.readouterr().err


def test_head_dim_and_qkv_bias_flags_reach_the_estimate(capsys):
    """--head-dim (Qwen3's head size) and --qkv-bias (Qwen2's) reach the estimate: Ψ grows by what the flags add,
    counted by hand: Q, K and V 4 × 24 = 96 rows each instead of 64, the output projection 96 inputs instead of
    64, and 3 × 96 QKV biases a layer where --no-bias has none."""
    base = SHAPE + ["--gpus", "1", "--no-bias", "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)["params_per_rank"]
    assert main(base + ["--head-dim", "24", "--qkv-bias"]) == 0
    qwen = json.loads(capsys.readouterr().out)["params_per_rank"]
    h, layers = 64, 2
    qkv_more = h * (3 * 4 * 24 - 3 * h)  # Q, K, V rows of 4 × 24 each (multi-head) instead of h
    proj_more = h * (4 * 24 - h)  # the output projection's input
    assert qwen - plain == layers * (qkv_more + proj_more + 3 * 4 * 24)
