"""Reading a Hugging Face directory is safe whatever its bytes: safetensors and JSON only, each tensor checked
against config.json before it is read, one line for each refusal, nothing executed."""
import json
import pickle

import pytest

from hf_models import save
from pretrain.errors import CheckpointError
from pretrain.checkpoint.hf import ImportedModel, check_matches, model_section, read_hf_config
from pretrain.config import load_config


class Payload:
    """Unpickling this would create the file it names: the proof that nothing was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    save("llama", directory)
    return directory


def refusal(directory) -> str:
    with pytest.raises(CheckpointError) as err:
        ImportedModel(directory)
    assert "\n" not in str(err.value)
    return str(err.value)


def copy(src, dst, edit=None):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if edit:
        config = json.loads((dst / "config.json").read_text())
        edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_pickled_checkpoint_is_refused_unread(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path / "bin")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(tmp_path / "pwned")))
    assert "pytorch_model.bin are pickles, which zero3d never loads" in refusal(d)
    assert not (tmp_path / "pwned").exists()


def test_remote_code_and_unsupported_architectures_are_refused(tmp_path, llama_dir):
    auto = copy(llama_dir, tmp_path / "auto", lambda c: c.update(auto_map={"AutoModelForCausalLM": "x.Model"}))
    assert "names remote code (auto_map)" in refusal(auto)
    other = copy(llama_dir, tmp_path / "phi3", lambda c: c.update(architectures=["Phi3ForCausalLM"]))
    assert refusal(other).endswith("architecture 'Phi3ForCausalLM' is not supported; supported: GPT2LMHeadModel, "
                                   "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM")
    scaled = copy(llama_dir, tmp_path / "yarn", lambda c: c.update(rope_parameters={"rope_type": "yarn",
                                                                                     "rope_theta": 1e4}))
    assert "RoPE type 'yarn' is not supported; supported: 'default', 'llama3'" in refusal(scaled)
    qwen3 = tmp_path / "qwen3"
    save("qwen3", qwen3)
    assert ImportedModel(qwen3).model["qk_layernorm"] is True
    # a window in the second layer only (max_window_layers 1 of 2)
    window = copy(qwen3, tmp_path / "window", lambda c: c.update(use_sliding_window=True, sliding_window=4,
                                                                 layer_types=["full_attention", "sliding_attention"]))
    assert refusal(window) == ("config.json (Qwen3ForCausalLM): a sliding window of 4 in layers 1-1 only is not "
                               "supported; supported: the window in every layer or in none")
    everywhere = copy(qwen3, tmp_path / "everywhere", lambda c: c.update(
        use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention"] * 2))
    imported = ImportedModel(everywhere).model  # a window in every layer: model.sliding_window, runs at <= 4 tokens
    assert (imported["sliding_window"], imported["seq_length"]) == (4, 4)
    biased = copy(qwen3, tmp_path / "biased", lambda c: c.update(attention_bias=True))
    assert refusal(biased).startswith("config.json (Qwen3ForCausalLM): attention_bias = true is not supported")


def test_a_config_that_disagrees_with_its_tensors_is_refused_before_any_is_read(tmp_path, llama_dir):
    wider = copy(llama_dir, tmp_path / "wider", lambda c: c.update(intermediate_size=96))
    assert "tensor 'model.layers.0.mlp.down_proj.weight' is F32 [48, 80]; config.json describes [48, 96]" in (
        refusal(wider))


def test_a_missing_shard_is_named(tmp_path, llama_dir):
    d = copy(llama_dir, tmp_path / "sharded")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.norm.weight": "model-00001-of-00002.safetensors", "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    assert refusal(d).endswith("names shard 'model-00002-of-00002.safetensors', which is missing from " + str(d))


def test_init_from_a_model_of_another_shape_names_each_key(llama_dir):
    model = model_section(read_hf_config(llama_dir))
    cfg = load_config(None, ['model.position_embedding="rope"', 'model.mlp="swiglu"', 'model.norm="rmsnorm"',
                             "model.bias=false", "model.hidden_size=48", "model.num_attention_heads=6",
                             "model.num_query_groups=2", "model.ffn_hidden_size=80", "model.vocab_size=250",
                             "model.rope_base=500000", "model.num_layers=3"])
    with pytest.raises(CheckpointError, match=r"holds another model: model\.num_layers = 3 \(it has 2\) \(python -m"):
        check_matches({"position_embedding": "rope", **model}, cfg.model, "hf")



def test_rope_leaves_the_sequence_length_free_and_learned_positions_do_not(tmp_path, llama_dir):
    """A RoPE model computes any sequence length (train.init_from of the Llama at 64 or 16 positions is its model); a
    learned position table has its n_positions rows, so GPT-2's at another length is another model, named."""
    llama = {"position_embedding": "rope", **model_section(read_hf_config(llama_dir))}
    keys = ['model.position_embedding="rope"', 'model.mlp="swiglu"', 'model.norm="rmsnorm"', "model.bias=false",
            "model.hidden_size=48", "model.num_attention_heads=6", "model.num_query_groups=2", "model.ffn_hidden_size=80",
            "model.vocab_size=250", "model.rope_base=500000", "model.num_layers=2", "model.tie_embeddings=false"]
    for seq in (16, 32, 64):
        check_matches(llama, load_config(None, keys + [f"model.seq_length={seq}"]).model, "hf")
    save("gpt2", tmp_path / "gpt2")
    gpt2 = ImportedModel(tmp_path / "gpt2").model
    keys = ["model.hidden_size=48", "model.num_attention_heads=4", "model.ffn_hidden_size=100", "model.vocab_size=250",
            "model.num_layers=2", "model.tie_embeddings=true"]
    check_matches(gpt2, load_config(None, keys + ["model.seq_length=32"]).model, "hf")
    for seq in (16, 64):
        with pytest.raises(CheckpointError, match=rf"holds another model: model\.seq_length = {seq} \(it has 32\) \("):
            check_matches(gpt2, load_config(None, keys + [f"model.seq_length={seq}"]).model, "hf")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_tied_llama_or_qwen3_imports_as_a_tied_model(tmp_path, kind):
    """tie_word_embeddings (Llama 3.2 1B, Qwen3 0.6B): the directory holds no lm_head; it imports as a model with
    model.tie_embeddings = true whose word embedding is transformers' input embedding (its output layer too)."""
    import torch

    from hf_models import build
    hf = build(kind, tied=True)
    hf.save_pretrained(tmp_path)
    imported = ImportedModel(tmp_path)
    assert imported.model["tie_embeddings"] is True and "output_layer.weight" not in imported.recipe
    assert torch.equal(imported.tensor("embedding.word_embeddings.weight"), hf.get_output_embeddings().weight)

def test_hf_config_prints_the_model_section(llama_dir, capsys):
    from pretrain.hf_config import main
    assert main([str(llama_dir)]) == 0
    out = capsys.readouterr().out
    assert "[model]\nnum_layers = 2\nhidden_size = 48\nnum_attention_heads = 6\nffn_hidden_size = 80\n" in out
    assert ('position_embedding = "rope"\nrope_base = 500000\nmlp = "swiglu"\nnorm = "rmsnorm"\nnorm_epsilon = 1e-05\n'
            "num_query_groups = 2\n") in out
    assert "None" not in out and "head_dim" not in out  # unset keys are left out (hidden / heads: the default)


def test_export_refuses_a_model_no_hf_class_computes():
    from pretrain.checkpoint.hf import architecture, hf_config
    base = {"num_attention_heads": 4, "num_query_groups": None, "rope_scaling_factor": None, "qk_layernorm": False,
            "hidden_size": 32}
    with pytest.raises(CheckpointError, match="no Hugging Face architecture computes this model"):
        architecture({**base, "position_embedding": "rope", "mlp": "gelu", "norm": "layernorm", "bias": True})
    gpt2 = {"position_embedding": "learned", "mlp": "gelu", "norm": "layernorm", "bias": True}
    with pytest.raises(CheckpointError, match=r"computes this model \(.*qk_layernorm = True.*\); supported: GPT2LMHeadModel "
                                              r".*; Qwen3ForCausalLM \(Llama's with qk_layernorm = true, no biases"):
        architecture({**base, **gpt2, "qk_layernorm": True})  # GPT-2 has no q/k norms
    llama = {"position_embedding": "rope", "mlp": "swiglu", "norm": "rmsnorm", "bias": False}
    with pytest.raises(CheckpointError, match=r"bias = True.*qk_layernorm = True"):  # Qwen3's MLP has no biases
        architecture({**base, **llama, "bias": True, "qk_layernorm": True})
    with pytest.raises(CheckpointError, match=r"qk_layernorm = True.*rope_scaling_factor = 8\.0"):  # Qwen3 unscaled
        architecture({**base, **llama, "rope_scaling_factor": 8.0, "qk_layernorm": True})
    assert architecture({**base, **llama, "rope_scaling_factor": 8.0}) == "LlamaForCausalLM"  # Llama-3.1's
    qwen3 = hf_config({**base, **llama, "qk_layernorm": True, "hidden_size": 32, "num_layers": 2, "seq_length": 16,
                       "tie_embeddings": False}, 100)
    assert (qwen3["architectures"], qwen3["model_type"], qwen3["head_dim"]) == (["Qwen3ForCausalLM"], "qwen3", 8)
    assert qwen3["use_sliding_window"] is False and qwen3["layer_types"] == ["full_attention"] * 2
    assert "mlp_bias" not in qwen3 and qwen3["attention_bias"] is False


def test_a_damaged_safetensors_file_or_an_incomplete_config_is_one_line(tmp_path, llama_dir):
    garbage = copy(llama_dir, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a json header")
    assert refusal(garbage).startswith(f"{garbage / 'model.safetensors'} cannot be read as safetensors: ")
    no_layers = copy(llama_dir, tmp_path / "no_layers", lambda c: c.pop("num_hidden_layers"))
    assert refusal(no_layers) == "config.json (LlamaForCausalLM) lacks 'num_hidden_layers'"
    odd = copy(llama_dir, tmp_path / "odd", lambda c: c.update(num_attention_heads=4))  # head_dim 8 × 4 ≠ 48: fine,
    assert "config.json describes [48, 32]" in refusal(odd)  # but the file's projections are of 6 heads
    zero = copy(llama_dir, tmp_path / "zero", lambda c: c.update(num_hidden_layers=0))
    assert refusal(zero) == "config.json (LlamaForCausalLM): num_hidden_layers = 0 is not a positive integer"
    wide = copy(llama_dir, tmp_path / "wide", lambda c: c.update(num_key_value_heads=4))  # 4 groups of 6 heads
    assert refusal(wide).startswith(f"{wide / 'config.json'} describes no buildable model: model.num_query_groups = 4 "
                                    "is invalid; it must divide model.num_attention_heads = 6")



def test_the_exported_config_carries_rope_theta_for_transformers_4_and_5(llama_dir):
    """transformers 5 reads RoPE's base from rope_parameters, 4.x from a top-level rope_theta (LlamaConfig's own
    argument there; it has no rope_parameters): the export's config (families' rope_keys) writes both, equal, and 5
    reads rope_parameters as before."""
    from transformers import LlamaConfig

    from pretrain.checkpoint.hf import hf_config
    model = {"position_embedding": "rope", "num_query_groups": None, "rope_scaling_factor": None,
             "qk_layernorm": False, **model_section(read_hf_config(llama_dir))}
    config = hf_config(model, model["vocab_size"])
    theta = float(model["rope_base"])
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == theta
    without = {k: v for k, v in config.items() if k != "rope_theta"}
    assert LlamaConfig(**config).rope_parameters == LlamaConfig(**without).rope_parameters == {
        "rope_theta": theta, "rope_type": "default"}
