"""A checkpoint's identity (pretrain.checkpoint.checkpointer.run_identity) refuses another padded vocabulary, model shape or data prefix."""
import pytest

from gpt_harness import BASE
from pretrain.checkpoint.checkpointer import run_identity
from pretrain.checkpoint.read import check_identity
from pretrain.config import load_config
from pretrain.errors import CheckpointError


def identity(tmp_path, overrides=(), tp=1, prefix="data/a"):
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"the same tokenizer")
    return run_identity(load_config(None, BASE + ["model.make_vocab_size_divisible_by=64", *overrides]).model, tp,
                        tokenizer, prefix)


def test_the_same_run_is_accepted(tmp_path):
    check_identity(tmp_path, identity(tmp_path), identity(tmp_path))


def test_tp_that_pads_the_vocabulary_differently_is_refused_naming_padded_vocab_size(tmp_path):
    """vocab 128, padded to a multiple of 64 × TP: 128 at TP 1 and 2, 256 at TP 4."""
    check_identity(tmp_path, identity(tmp_path, tp=1), identity(tmp_path, tp=2))
    with pytest.raises(CheckpointError, match=r"model\.padded_vocab_size: saved 128, now 256"):
        check_identity(tmp_path, identity(tmp_path, tp=1), identity(tmp_path, tp=4))


@pytest.mark.parametrize("overrides,prefix,diff", [
    (["model.hidden_size=64"], "data/a", r"model\.hidden_size: saved 32, now 64"),
    (["model.num_layers=3"], "data/a", r"model\.num_layers: saved 2, now 3"),
    ([], "data/b", r"data_prefix: saved 'data/a', now 'data/b'"),
    (['model.mlp="swiglu"'], "data/a", r"model\.mlp: saved 'gelu', now 'swiglu'"),
    (["model.num_query_groups=2"], "data/a", r"model\.num_query_groups: saved 4, now 2"),
    (['model.position_embedding="rope"'], "data/a", r"model\.position_embedding: saved 'learned', now 'rope'.*"
                                                     r"model\.rope_base: saved None, now 10000"),
    (['model.norm="rmsnorm"'], "data/a", r"model\.norm: saved 'layernorm', now 'rmsnorm'"),
], ids=["hidden", "layers", "data_prefix", "mlp", "query_groups", "rope", "norm"])
def test_another_model_shape_or_data_prefix_is_refused(tmp_path, overrides, prefix, diff):
    with pytest.raises(CheckpointError, match="written for another model, tokenizer or data: .*" + diff):
        check_identity(tmp_path, identity(tmp_path), identity(tmp_path, overrides, prefix=prefix))


GPT2_IDENTITY_KEYS = {"num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                      "tie_embeddings", "padded_vocab_size"}


@pytest.mark.parametrize("overrides,diff", [
    ([], None),
    (['model.mlp="swiglu"'], r"model\.mlp: saved 'gelu', now 'swiglu'"),
    (["model.bias=false"], r"model\.bias: saved True, now False"),
    (["model.num_query_groups=1"], r"model\.num_query_groups: saved 4, now 1"),
], ids=["gpt2", "swiglu", "no-bias", "mqa"])
def test_a_checkpoint_older_than_the_architecture_keys_is_the_gpt2_it_was(tmp_path, overrides, diff):
    """Checkpoints written before the architecture keys carry only GPT-2's shape keys: they resume as GPT-2
    (learned positions, GELU, LayerNorm, biases, one KV head per head) and are refused by anything else."""
    old = identity(tmp_path)
    old["model"] = {k: v for k, v in old["model"].items() if k in GPT2_IDENTITY_KEYS}
    if diff is None:
        check_identity(tmp_path, old, identity(tmp_path))
    else:
        with pytest.raises(CheckpointError, match=diff):
            check_identity(tmp_path, old, identity(tmp_path, overrides))


ROPE = ['model.position_embedding="rope"']
SCALED = ROPE + ["model.rope_scaling_factor=8.0"]


@pytest.mark.parametrize("saved,now,diff", [
    ([], ["model.num_attention_heads=2"],  # multi-head: the K/V groups follow the heads
     r"model\.num_attention_heads: saved 4, now 2; model\.num_query_groups: saved 4, now 2"),
    (["model.num_query_groups=2"], ["model.num_attention_heads=8", "model.num_query_groups=4"],
     r"model\.num_attention_heads: saved 4, now 8; model\.num_query_groups: saved 2, now 4"),
    (ROPE, ROPE + ["model.rope_base=500000"], r"model\.rope_base: saved 10000, now 500000"),
    ([], ["model.norm_epsilon=1e-06"], r"model\.norm_epsilon: saved 1e-05, now 1e-06"),
    ([], ['model.mlp="gelu_tanh"'], r"model\.mlp: saved 'gelu', now 'gelu_tanh'"),
    (SCALED, SCALED + ["model.rope_scaling_low_freq_factor=2.0"],
     r"model\.rope_scaling_low_freq_factor: saved 1\.0, now 2\.0"),
    (SCALED, SCALED + ["model.rope_scaling_original_max_positions=4096"],
     r"model\.rope_scaling_original_max_positions: saved 8192, now 4096"),
    (ROPE, ROPE + ["model.sliding_window=64"], r"model\.sliding_window: saved None, now 64"),
    (["model.num_attention_heads=2", "model.head_dim=32"], ["model.num_attention_heads=4", "model.head_dim=16"],
     r"model\.head_dim: saved 32, now 16; model\.num_attention_heads: saved 2, now 4; model\.num_query_groups: "
     r"saved 2, now 4"),
], ids=["heads", "heads-and-groups", "rope-base", "norm-epsilon", "gelu-tanh", "rope-low-freq", "rope-original",
        "sliding-window", "head-size"])
def test_a_changed_model_that_keeps_every_tensor_shape_is_refused(tmp_path, saved, now, diff):
    """The changes a tensor-by-tensor load cannot see (issue #40's combination: identity × resume refusal): more
    heads of a smaller width over the same hidden size, the same K/V width from other (heads, groups), another RoPE
    base or norm epsilon. Every parameter keeps its name and shape, yet the identity names the change."""
    def shapes(overrides):
        return load_config(None, BASE + ["model.make_vocab_size_divisible_by=64", *overrides]).model.shape.parameter_shapes()
    assert shapes(saved) == shapes(now)
    check_identity(tmp_path, identity(tmp_path, saved), identity(tmp_path, saved))
    with pytest.raises(CheckpointError, match="written for another model, tokenizer or data: " + diff + r"\."):
        check_identity(tmp_path, identity(tmp_path, saved), identity(tmp_path, now))


def test_another_optimizer_or_fp32_states_into_bf16_ones_is_refused_and_bf16_into_fp32_allowed(tmp_path):
    """pretrain/checkpoint/read.py's check_optimizer, which find_usable runs before the model exists: the optimizer's
    name must match; fp32 states would be rounded into bf16 ones (refused), bf16 ones widen exactly into fp32 (a note);
    a manifest of before the state dtype was recorded holds fp32 states."""
    from pretrain.checkpoint.read import check_optimizer
    old = {"optimizer": "adamw", "optimizer_step": 3}
    assert check_optimizer(tmp_path, old, "adamw", "fp32") is None
    with pytest.raises(CheckpointError, match=r"its optimizer states are adamw's \(optimizer.name = 'adamw'\); this "
                                              r"run's optimizer.name is 'muon'"):
        check_optimizer(tmp_path, old, "muon", "fp32")
    with pytest.raises(CheckpointError, match=r"its adamw states are fp32; optimizer.state_dtype = 'bf16' would round "
                                              r"them"):
        check_optimizer(tmp_path, old, "adamw", "bf16")
    bf16 = {**old, "optimizer_state_dtype": "bf16"}
    assert check_optimizer(tmp_path, bf16, "adamw", "bf16") is None
    assert "its bf16 optimizer states continue as fp32 ones (exactly)" in check_optimizer(tmp_path, bf16, "adamw", "fp32")


@pytest.mark.parametrize("now,diff", [
    ([], None),
    (["model.rope_scaling_high_freq_factor=8.0"], r"model\.rope_scaling_high_freq_factor: saved 4\.0, now 8\.0"),
    (["model.bias=false", "model.qkv_bias=true"], r"model\.bias: saved True, now False; model\.qkv_bias: saved "
                                                  r"False, now True"),
], ids=["same", "another-high-freq-factor", "qkv-bias"])
def test_a_checkpoint_older_than_the_families_keys_is_the_model_megatron_computed(tmp_path, now, diff):
    """Checkpoints written before head_dim, qkv_bias, sliding_window and the RoPE scaling's three other values were
    keys: their scaling was megatron's own (low 1, high 4, original 8192: the keys' defaults), their heads hidden /
    heads, no QKV-only biases, no window; they resume as that model and are refused by another."""
    from pretrain.checkpoint.read import ROPE_SCALING_KEYS
    old = identity(tmp_path, SCALED)
    for key in ("qkv_bias", "head_dim", "sliding_window", *ROPE_SCALING_KEYS):
        del old["model"][key]
    if diff is None:
        check_identity(tmp_path, old, identity(tmp_path, SCALED))
    else:
        with pytest.raises(CheckpointError, match=diff):
            check_identity(tmp_path, old, identity(tmp_path, SCALED + now))
