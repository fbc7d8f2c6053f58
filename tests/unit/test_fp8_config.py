"""precision.fp8's and zero.fp8_gather's refusals, each one line naming the value and what would be valid; `auto`
attention with float8 linears; the device check (no float8 matmuls below compute capability 8.9)."""
from pathlib import Path

import pytest
import torch

from pretrain.config import ConfigError, load_config
from pretrain.model import attention
from pretrain.model.attention import resolve

REPO = Path(__file__).resolve().parents[2]
FP8 = ["precision.dtype=bf16", "precision.fp8=tensorwise"]  # configs/tiny.toml: h 128, 4 heads, ffn 512, TP 2


@pytest.mark.parametrize("overrides,message", [
    (["precision.fp8=tensorwise"], "precision.fp8 = 'tensorwise' needs precision.dtype = \"bf16\" (the float8 GEMMs "
                                   "take and give bf16), not 'fp32'; set precision.dtype = \"bf16\" or precision.fp8 = "
                                   "\"none\""),
    (FP8 + ["model.attention=te"], "precision.fp8 = 'tensorwise' with model.attention = 'te' is refused"),
    (FP8 + ["model.hidden_size=136", "model.num_attention_heads=4"],
     "needs every dimension of its GEMMs divisible by 16 (torch._scaled_mm on CUDA), but model.hidden_size = 136 is not "
     "a multiple of 16; choose sizes that are, or precision.fp8 = \"none\""),
    (FP8 + ["model.hidden_size=144", "model.num_attention_heads=4"],
     "model.hidden_size / parallel.tensor = 72 is not"),
    (FP8 + ["model.num_attention_heads=8", "model.num_query_groups=2", "model.hidden_size=160", "parallel.tensor=2",
            "model.ffn_hidden_size=640"], "QKV width / parallel.tensor = 120 is not"),  # 160 + 2 × 2 × 20 = 240
    (FP8 + ["model.ffn_hidden_size=488"], "model.ffn_hidden_size / parallel.tensor = 244 is not"),
    (FP8 + ["model.seq_length=60", "train.micro_batch_size=2"],
     "tokens of a micro-batch (train.micro_batch_size × model.seq_length / parallel.context) = 120 is not"),
    (["zero.fp8_gather=true", "zero.stage=3"], "zero.fp8_gather = true needs precision.fp8 = \"tensorwise\""),
    (["precision.dtype=bf16", "precision.fp8=rowwise", "zero.fp8_gather=true", "zero.stage=3"],
     "zero.fp8_gather = true needs precision.fp8 = \"tensorwise\" (the gathered weight carries one scale), not "
     "'rowwise'; set precision.fp8 = \"tensorwise\" or zero.fp8_gather = false"),
    (FP8 + ["zero.fp8_gather=true", "zero.stage=2"], "zero.fp8_gather = true needs zero.stage = 3"),
    (FP8 + ["zero.fp8_gather=true", "zero.stage=3", "zero.quantize_weights=int8"],
     "zero.fp8_gather = true with zero.secondary_partition or zero.quantize_weights is refused"),
    (["precision.fp8=fp8"], "precision.fp8 = 'fp8' is invalid; valid values: 'none', 'tensorwise', 'rowwise'"),
])
def test_refusals_name_the_value_and_what_is_valid(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/tiny.toml", overrides)
    assert message in str(err.value)
    assert "\n" not in err.value.line()


def test_a_shape_whose_every_gemm_dimension_is_a_multiple_of_16_is_accepted():
    cfg = load_config(REPO / "configs/tiny_llama.toml", FP8 + ["zero.stage=3", "zero.fp8_gather=true"])
    assert (cfg.precision.fp8, cfg.zero.fp8_gather) == ("tensorwise", True)


def test_auto_attention_with_float8_linears_takes_megatrons_local_layers(monkeypatch):
    monkeypatch.setattr(attention, "_te_importable", lambda: True)  # a GPU node with Transformer Engine
    assert resolve("auto", on_cuda=True, zero_recompute=False) == "te"
    assert resolve("auto", on_cuda=True, zero_recompute=False, float8=True) == "sdpa"


def test_a_gpu_without_float8_matmuls_is_refused_in_one_line(monkeypatch):
    from pretrain.model.fp8 import check_float8_device
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError) as err:
        check_float8_device("rowwise", torch.device("cuda", 0))
    assert err.value.line() == ("error: precision.fp8 = 'rowwise' cannot run here: NVIDIA A100-SXM4-80GB has compute "
                                "capability 8.0; float8 matmuls need 8.9 or newer (Ada, Hopper, Blackwell) (config): "
                                "use precision.fp8 = \"none\"")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_device("rowwise", torch.device("cuda", 0))  # an H100: no refusal
    check_float8_device("none", torch.device("cuda", 0))
