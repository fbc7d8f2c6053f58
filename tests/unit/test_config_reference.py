"""docs/config.md lists every key of every section, as the classes define them; overrides can unset keys,
and a key made unused by another is an error naming both."""
import dataclasses
import re
from pathlib import Path

import pytest

from pretrain.config import Config, ConfigError, load_config
from pretrain.config_reference import reference

REPO = Path(__file__).resolve().parents[2]


def test_docs_config_md_is_the_generated_reference():
    assert (REPO / "docs/config.md").read_text() == reference(), (
        "docs/config.md is stale: python -m pretrain.config_reference > docs/config.md")


def test_every_key_of_every_section_is_listed_once_with_its_default():
    listed = re.findall(r"^\| `(\w+)\.(\w+)` \| [^|]*(?:\\\|[^|]*)* \| ([^|]+) \|", (REPO / "docs/config.md").read_text(), re.M)
    keys = [(s.name, f.name) for s in dataclasses.fields(Config) for f in dataclasses.fields(getattr(Config(), s.name))]
    assert [(a, b) for a, b, _ in listed] == keys
    defaults = {f"{a}.{b}": d.strip() for a, b, d in listed}
    assert defaults["zero.stage"] == "`0`" and defaults["data.corpus"] == "unset"
    assert defaults["optimizer.decay_steps"] == "unset" and defaults["model.tie_embeddings"] == "`false`"


def test_a_key_without_documentation_is_refused(monkeypatch):
    import pretrain.config_reference as ref
    real = ref.field_docs
    monkeypatch.setattr(ref, "field_docs", lambda cls: {k: v for k, v in real(cls).items() if k != "save_interval"})
    with pytest.raises(ValueError, match="config keys without a docstring: train.save_interval;"):
        reference()


def test_an_override_unsets_a_key_of_the_toml_file(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[data]\ncorpus = "elsewhere.jsonl"\n[zero]\nstage = 3\n')
    cfg = load_config(toml, ["~data.corpus", "~zero.stage", "data.blend=a", "data.tokenizer_model=t.model"])
    assert (cfg.data.corpus, cfg.zero.stage, cfg.data.blend) == (None, 0, "a")
    assert not cfg.is_set("data.corpus") and cfg.is_set("data.blend")
    with pytest.raises(ConfigError, match=r"unknown config key 'data.corpse' \(did you mean 'corpus'\?\)"):
        load_config(toml, ["~data.corpse"])
    with pytest.raises(ConfigError, match=r"override '~data' must look like ~section.key"):
        load_config(toml, ["~data"])


@pytest.mark.parametrize("given,line", [
    (['data.corpus="x.jsonl"', "data.blend=a", "data.tokenizer_model=t"],
     "data.corpus and data.blend are both set, but data.corpus is unused with data.blend (a blend reads its "
     ".bin/.idx prefixes instead); remove one (an override can unset a key of the TOML file: ~data.corpus)"),
    (['data.split="90,10"', "data.train_blend=a", "data.valid_blend=b", "data.tokenizer_model=t"],
     "data.split and data.train_blend are both set, but data.split is unused with data.train_blend (per-split "
     "blends are not split); remove one (an override can unset a key of the TOML file: ~data.split)"),
], ids=["corpus-beside-blend", "split-beside-train-blend"])
def test_a_key_made_unused_by_another_is_an_error_naming_both(given, line):
    with pytest.raises(ConfigError) as err:
        load_config(None, given)
    assert str(err.value) == line
    load_config(None, given[1:])  # either alone is fine
