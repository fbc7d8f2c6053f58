"""Config loading and validation, launcher environments, megatron version guard."""
import re
from pathlib import Path

import pytest

from pretrain.config import ConfigError, load_config, validate_layout
from pretrain.runtime.layout import expand_nodelist, launcher_env

REPO = Path(__file__).resolve().parents[2]


def test_tiny_preset_loads_and_overrides_apply():
    cfg = load_config(REPO / "configs/tiny.toml", ["zero.stage=1", "logging.name=abc", "optimizer.lr=1e-2"])
    assert (cfg.parallel.tensor, cfg.zero.stage, cfg.logging.name, cfg.optimizer.lr) == (2, 1, "abc", 1e-2)
    assert cfg.to_dict()["model"]["num_layers"] == 4


@pytest.mark.parametrize("overrides,message", [
    (["model.hiden_size=3"], "unknown config key 'model.hiden_size' (did you mean 'hidden_size'?)"),
    (["modle.hidden_size=3"], "unknown config key 'modle'"),
    (["zero.stage=5"], "zero.stage = 5 is invalid; valid values: 0, 1, 2, 3"),
    (["model.num_layers=two"], "model.num_layers = 'two' is invalid; expected an integer"),
    (["model.num_layers=0"], "model.num_layers = 0 is invalid; must be > 0"),
    (["model.tie_embeddings=1"], "model.tie_embeddings = 1 is invalid; expected true or false"),
    (["precision.dtype=fp8"], "precision.dtype = 'fp8' is invalid; valid values: 'fp32', 'bf16', 'fp16'"),
    (["model.num_attention_heads=3"], "model.hidden_size = 128 is not divisible by model.num_attention_heads = 3"),
    (["parallel.tensor=8"], "model.num_attention_heads = 4 is not divisible by parallel.tensor = 8"),
    (["parallel.pipeline=3"], "model.num_layers = 4 is not divisible by parallel.pipeline = 3"),
    (["parallel.pipeline=2", "zero.stage=3"], "zero.stage = 3 with parallel.pipeline = 2 is not supported"),
    (["parallel.sequence_parallel=true", "model.recompute=\"full\"", "zero.partition_activations=true"],
     "each TP rank already stores only its 1/TP of every checkpoint, so Pa would partition it twice"),
    (["parallel.sequence_parallel=true", "parallel.tensor=1"], "parallel.sequence_parallel = true needs parallel.tensor > 1"),
    (["zero.cpu_checkpointing=true"], "zero.cpu_checkpointing = true needs zero.partition_activations = true"),
    (["zero.partition_activations=true"], "need model.recompute = \"full\""),
    (["optimizer.min_lr=1.0"], "optimizer.min_lr = 1.0 must be in [0, optimizer.lr = 0.003]"),
    (["model.hidden_dropout=1.5"], "model.hidden_dropout = 1.5 must be in [0, 1)"),
    (["zero.stage"], "override 'zero.stage' must look like section.key=value"),
    (["stage=1"], "override key 'stage' must be section.key"),
    (["model.attention=\"flash\""], "model.attention = 'flash' is invalid; valid values: 'auto', 'sdpa', 'local', 'te'"),
    (["model.loss_chunk_tokens=-1"], "model.loss_chunk_tokens = -1 is invalid; must be >= 0"),
    (["model.recompute=\"selective\"", "parallel.context=2", "model.seq_length=64", "model.attention=\"sdpa\""],
     "model.recompute = \"selective\" with parallel.context = 2 is not supported"),
])
def test_bad_values_name_key_value_and_what_is_valid(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/tiny.toml", overrides)
    assert message in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="config file '/nope.toml' does not exist"):
        load_config("/nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\nnum_layers = 2\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)
    flat = tmp_path / "flat.toml"
    flat.write_text("model = 3\n")
    with pytest.raises(ConfigError, match=r"\[model\] in .* must be a table of keys"):
        load_config(flat)


def test_layout_validation_happens_before_any_collective():
    cfg = load_config(REPO / "configs/tiny.toml")  # TP 2, micro 4, global 16
    assert validate_layout(cfg, 4) == 2  # DP 2 → 2 accumulation steps
    with pytest.raises(ConfigError, match="world size 3 is not divisible by parallel.tensor × parallel.pipeline = 2"):
        validate_layout(cfg, 3)
    with pytest.raises(ConfigError, match=r"train.global_batch_size = 16 is not divisible by train.micro_batch_size "
                                          r"× data-parallel size = 4 × 3 = 12; valid global batch sizes are "
                                          r"multiples of 12"):
        validate_layout(cfg, 6)


@pytest.mark.parametrize("nodelist,hosts", [
    ("node1", ["node1"]),
    ("gpu[01-03,07]", ["gpu01", "gpu02", "gpu03", "gpu07"]),
    ("a[9-10],login1,b[1]", ["a9", "a10", "login1", "b1"]),
])
def test_slurm_nodelist_expansion(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_launcher_env_from_slurm(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NODELIST", "gpu[03-04]")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert launcher_env() == dict(rank=5, world_size=16, local_rank=1, master_addr="gpu03",
                                  master_port=str(20000 + 4242))


def test_launcher_env_prefers_torchrun(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert launcher_env() == dict(rank=2, world_size=4, local_rank=2, master_addr="10.0.0.1", master_port="1234")


def test_megatron_version_guard(monkeypatch):
    import megatron_patches.version as version
    monkeypatch.setattr(version, "version", lambda name: "0.12.0")
    with pytest.raises(RuntimeError, match=r"megatron-core 0.12.0 is not supported by megatron_patches: "
                                           r"tested on 0.16.x. Install megatron-core==0.16.1."):
        version.check_megatron_version()
    import megatron_patches
    with pytest.raises(ValueError, match="device_type must be 'cpu' or 'cuda', got 'tpu'"):
        monkeypatch.setattr(version, "version", lambda name: "0.16.1")
        megatron_patches.apply("tpu")


@pytest.mark.parametrize("overrides,message", [
    (["parallel.context=3"], "parallel.context = 3 does not split model.seq_length = 128 into 2 × 3 equal chunks; "
                             "valid parallel.context values for this sequence length: 1, 2, 4, 8, 16, 32, 64"),
    (["parallel.context=2", "model.attention=\"local\""], "parallel.context > 1 with model.attention = 'local' is refused"),
    (["parallel.context=2", "model.attention_dropout=0.1"], "parallel.context > 1 with model.attention_dropout = 0.1"),
    (["parallel.context=2", "data.reset_attention_mask=true"], "data.reset_attention_mask = true is not supported yet"),
    (["parallel.context=0"], "parallel.context = 0 is invalid; must be >= 1"),
])
def test_context_parallel_values_it_cannot_run_are_one_line_each(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("configs/tiny.toml", overrides)


def test_context_counts_in_the_world_size():
    cfg = load_config("configs/tiny.toml", ["parallel.context=2"])
    with pytest.raises(ConfigError, match=re.escape("world size 6 is not divisible by parallel.tensor × "
                                                    "parallel.pipeline × parallel.context = 4; valid world sizes "
                                                    "are multiples of 4")):
        validate_layout(cfg, 6)
    assert validate_layout(cfg, 8) == 16 // (4 * 2)  # global 16, micro 4, dp = 8 / (2 · 2) = 2
