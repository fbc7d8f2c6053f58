"""The estimator against a real run: model-state and checkpoint bytes within 5% of what zero3d measured."""
import pytest

import zero3d
from ranks import run_ranks
from gpt_harness import BASE, run_gpt_steps
from pretrain.config import load_config
from pretrain.memory_check import estimate_config

TP, DP = 2, 2
LAYOUT = [f"parallel.tensor={TP}", "train.global_batch_size=4"]


def measured_and_estimated(overrides):
    out = run_ranks(run_gpt_steps, TP * DP, LAYOUT + overrides, 2)[0]
    estimate = estimate_config(load_config(None, BASE + LAYOUT + overrides), TP * DP, 80e9)
    return out, estimate


@pytest.mark.parametrize("stage", sorted(zero3d.STAGES))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_model_state_bytes_within_5_percent(stage, dtype):
    out, estimate = measured_and_estimated([f"zero.stage={stage}", f"precision.dtype={dtype}"])
    assert estimate.params_per_rank == out["psi"]  # the estimator counts megatron's parameters exactly
    measured = sum(out["state_bytes"].values())
    assert measured == pytest.approx(estimate.model_state_bytes, rel=0.05)


@pytest.mark.parametrize("cpu", [False, True])
def test_activation_checkpoint_bytes_within_5_percent(cpu):
    out, estimate = measured_and_estimated([
        "model.recompute=\"full\"", "zero.partition_activations=true", f"zero.cpu_checkpointing={str(cpu).lower()}",
        "zero.stage=2"])
    acts = out["activations"]
    device_estimate = estimate.checkpoint_bytes
    host_estimate = estimate.host_bytes
    assert acts["act/ckpt_device_bytes"] == pytest.approx(device_estimate, rel=0.05, abs=0)
    assert acts["act/ckpt_host_bytes"] == pytest.approx(host_estimate, rel=0.05, abs=0)
    assert (device_estimate == 0) == cpu
