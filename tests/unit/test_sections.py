"""Each config section checks itself when built, and load_config rebuilds it from the merged TOML and overrides."""
import ast
from pathlib import Path

import pytest

from pretrain.config import ConfigError, load_config
from pretrain.sections import (ClusterConfig, DataConfig, LoggingConfig, ModelConfig, ParallelConfig, Section,
                               TrainConfig)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("section, values, message", [
    (ModelConfig, dict(num_layers=0), "model.num_layers = 0 is invalid; must be > 0"),
    (ModelConfig, dict(hidden_size=100, num_attention_heads=3),
     "model.hidden_size = 100 is not divisible by model.num_attention_heads = 3"),
    (ModelConfig, dict(init_method_std=float("nan")), "model.init_method_std = nan is invalid; must be a finite number"),
    (ModelConfig, dict(loss_chunk_tokens=0, loss_recompute=True),
     "model.loss_recompute = true needs model.loss_chunk_tokens > 0"),
    (ParallelConfig, dict(sequence_parallel=True), "parallel.sequence_parallel = true needs parallel.tensor > 1"),
    (ParallelConfig, dict(pipeline=0), "parallel.pipeline = 0 is invalid; must be >= 1"),
    (DataConfig, dict(blend="0.3 a 0.7"), "data.blend = '0.3 a 0.7' does not parse: 3 words mix weights and prefixes"),
    (DataConfig, dict(valid_blend="a", tokenizer_model="t.model"), "data.valid_blend needs data.train_blend"),
    (DataConfig, dict(split="0,1"), "data.split = '0,1' gives the training split no share"),
    (DataConfig, dict(cache_dir=" "), "data.cache_dir = ' ' is invalid; name a path"),
    (DataConfig, dict(corpus="x.jsonl", text_column=""), "data.text_column = '' is invalid; name a column"),
    (TrainConfig, dict(seed=-1), "train.seed = -1 is invalid; must be in [0, 2**32 - 2**20)"),
    (TrainConfig, dict(timeout_minutes=0.01), "train.timeout_minutes = 0.01 is invalid; must be at least 1 second"),
    (LoggingConfig, dict(name="a/b"), "logging.name = 'a/b' is invalid; must be a non-empty name without '/'"),
    (LoggingConfig, dict(straggler_factor=1.0), "logging.straggler_factor = 1.0 is invalid; must be a finite number > 1"),
    (ClusterConfig, dict(gpu_memory_gb=0.0), "cluster.gpu_memory_gb = 0.0 is invalid; must be > 0"),
    (ClusterConfig, dict(checkpoint_write_gbps=float("inf")), "cluster.checkpoint_write_gbps = inf is invalid; must be a finite"),
])
def test_a_section_refuses_a_bad_value_when_built(section, values, message):
    with pytest.raises(ConfigError) as err:
        section(**values)
    assert message in str(err.value)


def test_sections_are_checked_on_the_merged_values(tmp_path):
    """The TOML and the overrides set keys one at a time; the checks (and the blend parse) see the final tree."""
    toml = tmp_path / "c.toml"
    toml.write_text('[data]\nblend = "0.3 a 0.7"\ntokenizer_model = "t.model"\n[train]\neval_interval = 0\n')
    with pytest.raises(ConfigError, match=r"data.blend = '0.3 a 0.7' does not parse"):
        load_config(toml)
    assert load_config(toml, check=False).data.blend == "0.3 a 0.7"  # unchecked: what a failed run's status needs
    cfg = load_config(toml, ["data.blend='0.25 x 0.75 y'"])
    assert cfg.data.blends() == {"blend": (["x", "y"], [0.25, 0.75])}
    assert cfg.data.split_shares() == [0.95, 0.05, 0.0]


def test_every_section_field_has_a_docstring():
    tree = ast.parse((REPO / "pretrain/sections.py").read_text())
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef)
               and any(getattr(b, "id", "") == "Section" for b in node.bases)]
    assert {c.name for c in classes} == {cls.__name__ for cls in Section.__subclasses__()}
    undocumented = []
    for c in classes:
        for i, node in enumerate(c.body):
            if isinstance(node, ast.AnnAssign) and "ClassVar" not in ast.unparse(node.annotation):
                after = c.body[i + 1] if i + 1 < len(c.body) else None
                if not (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                        and isinstance(after.value.value, str)):
                    undocumented.append(f"{c.name}.{node.target.id}")
    assert undocumented == []
