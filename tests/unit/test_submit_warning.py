"""slurm/submit.py sizes the checkpoint from the bytes actually written (each element once) and the stop warning from it."""
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from pretrain.config import load_config  # noqa: E402
from slurm import submit  # noqa: E402

PAPER_100B = REPO / "configs/paper/fig2_100B_zero.toml"


def whole_model_params(layers, h, vocab, seq, tp, divisible_by=128):
    """Ψ from the shapes: per layer qkv + proj + fc1 + fc2 weights and biases + two LayerNorms
    (12h² + 13h), final LayerNorm, word embedding and untied output layer over the vocabulary padded
    to a multiple of 128 × TP, learned positions."""
    padded = -(-vocab // (divisible_by * tp)) * (divisible_by * tp)
    return layers * (12 * h * h + 13 * h) + 2 * h + 2 * padded * h + seq * h


@pytest.mark.parametrize("overrides", [[], ["zero.stage=3"], ["zero.stage=1"], ["cluster.nodes=5"]])
def test_checkpoint_bytes_are_each_element_once_whatever_the_layout(overrides):
    cfg = load_config(PAPER_100B, overrides)
    psi = whole_model_params(125, 8192, 50257, 1024, tp=16)
    assert submit.checkpoint_bytes(cfg) == 2 * psi + 12 * psi  # fp16 model + fp32 master + Adam's moments
    assert 1.4e12 < submit.checkpoint_bytes(cfg) < 1.45e12  # slurm/README: about 1.4 TB


def test_fp32_writes_four_bytes_per_model_element():
    cfg = load_config(REPO / "configs/tiny.toml")
    psi = whole_model_params(4, 128, 1024, 128, tp=2)
    assert psi == 1_071_872
    assert submit.checkpoint_bytes(cfg) == 4 * psi + 12 * psi


def test_stop_warning_writes_the_same_checkpoint_at_stage_2_and_stage_3():
    """Both write 14Ψ (the old world × shard sizing gave 2921 s against 968 s): each lead is 2 × (that write + its own
    modelled step) + 60 s."""
    write = 14 * whole_model_params(125, 8192, 50257, 1024, tp=16) / 5e9  # checkpoint_write_gbps default
    for stage in (2, 3):
        cfg = load_config(PAPER_100B, [f"zero.stage={stage}"])
        assert submit.warning_seconds(cfg, 25) == math.ceil(2 * (write + submit.step_seconds(cfg, 25)) + 60)
