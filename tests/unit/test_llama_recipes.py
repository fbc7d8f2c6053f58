"""The Llama-3 recipes and the architecture keys: Meta's parameter counts, Slurm dry runs, the planner's verdict,
and one-line errors for bad values."""
from pathlib import Path

import pytest

from pretrain.config import ConfigError, load_config
from analysis.cluster import ClusterSpec
from analysis.planner import plan

# Meta's published parameter counts (the Hugging Face model cards' safetensors totals): an independent reference
META_PARAMS = {"configs/llama3_8b.toml": 8_030_261_248, "configs/llama3_70b.toml": 70_553_706_496}


@pytest.mark.parametrize("path", list(META_PARAMS))
def test_recipe_has_metas_parameter_count(path):
    m = load_config(path).model
    assert m.shape.params() == META_PARAMS[path]
    assert (m.vocab_size, m.num_query_groups, m.rope_base, m.mlp, m.norm, m.bias, m.tie_embeddings) == (
        128256, 8, 500000, "swiglu", "rmsnorm", False, False)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A small BPE tokenizer.json with Llama-3's end-of-text token, standing in for Meta's (built here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end_of_text|>"]))
    path = tmp_path_factory.mktemp("llama3") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.mark.parametrize("path", list(META_PARAMS))
def test_recipe_dry_runs_on_slurm_and_the_planner_calls_its_layout_feasible(path, hf_tokenizer, capsys,
                                                                             monkeypatch):
    from slurm import submit
    for name in ("ZERO3D_PYTHON", "ZERO3D_CONTAINER", "ZERO3D_CONTAINER_MOUNTS", "ZERO3D_REQUEUE"):
        monkeypatch.delenv(name, raising=False)
    tokenizer = f'data.tokenizer_model="{hf_tokenizer}"'
    # the recipes name no data (refused so: test_submit_refusal.py); a blend's files, as the start-up check sees them
    blend = Path(hf_tokenizer).parent / "tokens"
    for suffix in (".bin", ".idx"):
        Path(f"{blend}{suffix}").touch()
    assert submit.main(["--config", path, "--dry-run", tokenizer, f"data.blend={blend}"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    cfg = load_config(path)
    assert f"# job {cfg.logging.name}: {cfg.cluster.nodes} node(s) × 8 GPU(s)" in out
    assert f"--nodes={cfg.cluster.nodes} --ntasks-per-node=8" in out and "--gpus-per-node=8" in out
    cluster = ClusterSpec("dgx-h100", nodes=cfg.cluster.nodes).cluster("bf16")
    found = plan(cluster, model=cfg.model.shape, global_batch=cfg.train.global_batch_size, recompute="full",
                 precision="bf16")
    assert any(c.tp == cfg.parallel.tensor and c.zero.stage == cfg.zero.stage and not c.zero.pa
               and not c.zero.zeropp and c.micro_batch == cfg.train.micro_batch_size for c in found)


def test_tiny_llama_validates_at_its_layout():
    from pretrain.config import validate_layout
    cfg = load_config("configs/tiny_llama.toml")
    assert validate_layout(cfg, 4) == 2 and cfg.model.shape.groups == 2


@pytest.mark.parametrize("overrides,message", [
    (["model.num_query_groups=3"], "model.num_query_groups = 3 is invalid; it must divide model.num_attention_heads = 4: "
                                   "valid values 1, 2, 4"),
    (["model.num_query_groups=1", "parallel.tensor=2"], "model.num_query_groups = 1 is not divisible by "
                                                        "parallel.tensor = 2"),
    (['model.mlp="relu"'], "model.mlp = 'relu' is invalid; valid values: 'gelu', 'gelu_tanh', 'swiglu'"),
    (['model.norm="batchnorm"'], "model.norm = 'batchnorm' is invalid; valid values: 'layernorm', 'rmsnorm'"),
    (['model.position_embedding="alibi"'], "model.position_embedding = 'alibi' is invalid; valid values: 'learned', "
                                           "'rope'"),
    (["model.norm_epsilon=0"], "model.norm_epsilon = 0.0 is invalid; must be > 0"),
    (["model.rope_base=500000"], "model.rope_base is set but model.position_embedding = 'learned' does not use it"),
    (["model.rope_scaling_factor=8.0"], "model.rope_scaling_factor = 8.0 is invalid"),
    (['model.position_embedding="rope"', "model.rope_scaling_factor=0.5"], "model.rope_scaling_factor = 0.5 is invalid"),
    (['model.position_embedding="rope"', "model.rope_scaling_factor=8.0", "model.rope_scaling_low_freq_factor=4.0"],
     "model.rope_scaling_low_freq_factor = 4.0 and rope_scaling_high_freq_factor = 4.0 are invalid; they must satisfy "
     "0 < low < high"),
    (['model.position_embedding="rope"', "model.rope_scaling_original_max_positions=0"],
     "model.rope_scaling_original_max_positions = 0 is invalid; must be > 0"),
    (['model.position_embedding="rope"', "model.rope_scaling_high_freq_factor=8.0"],
     "model.rope_scaling_high_freq_factor is set but model.rope_scaling_factor is unset"),
    (["model.qkv_bias=true"], "model.qkv_bias = true with model.bias = true is redundant"),
    (["model.head_dim=0"], "model.head_dim = 0 is invalid; must be > 0"),
    (["model.num_attention_heads=3"], "model.hidden_size = 64 is not divisible by model.num_attention_heads = 3; "
                                      "choose a head count that divides the hidden size (or set model.head_dim)"),
    (['model.position_embedding="rope"', "model.sliding_window=32"],
     "model.sliding_window = 32 does not cover model.seq_length = 64: zero3d's attention is full causal"),
    (['model.position_embedding="rope"', "data.reset_position_ids=true"],
     "data.reset_position_ids = true with model.position_embedding = 'rope' is refused"),
    (['optimizer.no_weight_decay="embeding.*"'], "optimizer.no_weight_decay pattern 'embeding.*' matches no "
                                                 "parameter of this model"),
    (['optimizer.no_weight_decay="embedding.*,,output_layer.weight"'],
     "optimizer.no_weight_decay = 'embedding.*,,output_layer.weight' has an empty pattern"),
    (['optimizer.no_weight_decay="*.linear_fc1.bias"', "model.bias=false"],
     "optimizer.no_weight_decay pattern '*.linear_fc1.bias' matches no parameter"),
])
def test_bad_architecture_values_get_one_line_naming_them(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_collect_counts_a_llama_run_from_its_config_json_and_an_older_one_as_gpt2():
    """slurm/collect.py's Ψ of a run directory's resolved config: Meta's count for the 8B; a config.json from before
    the architecture keys (configs/tiny.toml's, its keys removed) is the GPT-2 it was, 1,071,872 as the README says."""
    import dataclasses
    from slurm import collect
    assert collect.param_count(dataclasses.asdict(load_config("configs/llama3_8b.toml"))) == 8_030_261_248
    old = dataclasses.asdict(load_config("configs/tiny.toml"))
    for key in ("position_embedding", "rope_base", "rope_scaling_factor", "mlp", "norm", "norm_epsilon",
                "num_query_groups", "qk_layernorm", "bias"):
        del old["model"][key]
    assert collect.param_count(old) == 1_071_872
