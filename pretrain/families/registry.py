"""The registry of model families: a new family is its module in this package and one line of FAMILY_MODULES.

The HF import and export (pretrain/checkpoint/hf.py), `python -m pretrain.hf_config` and docs/families.md's table
read it: `by_architecture` (import: config.json's class), `for_model` (export: the one class that computes a
`[model]` section), `model_section` (config.json → `[model]`).
"""
import importlib

from pretrain.errors import CheckpointError
from pretrain.families.family import ARCHITECTURE_KEYS, MODEL_DEFAULTS, Family, complete

FAMILY_MODULES = (
    "gpt2",
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
)
FAMILIES: tuple[Family, ...] = tuple(importlib.import_module(f"pretrain.families.{name}").FAMILY
                                     for name in FAMILY_MODULES)
ARCHITECTURES = tuple(family.architecture for family in FAMILIES)


def by_architecture(architecture: str) -> Family:
    """The family of an HF class; CheckpointError naming the supported ones."""
    for family in FAMILIES:
        if family.architecture == architecture:
            return family
    raise CheckpointError(f"architecture {architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}")


def for_model(model: dict) -> Family:
    """The one family whose class computes this `[model]` section; CheckpointError naming its keys and what each
    family computes."""
    found = [family for family in FAMILIES if family.computes(model)]
    if len(found) == 1:
        return found[0]
    m = complete(model)
    keys = ", ".join(f"{k} = {m[k]!r}" for k in ARCHITECTURE_KEYS)
    if found:  # the families' predicates are exclusive (tests/unit/test_families.py): never reached
        raise CheckpointError(f"this model ({keys}) is computed by {', '.join(f.architecture for f in found)} alike")
    raise CheckpointError(f"no Hugging Face architecture computes this model ({keys}); supported: "
                          + "; ".join(f"{f.architecture} ({f.summary})" for f in FAMILIES))


def model_section(config: dict) -> dict:
    """The `[model]` keys that build the model an HF config.json describes (its class's family reads it);
    CheckpointError for a value no family computes, or a key config.json lacks."""
    family = by_architecture((config.get("architectures") or [None])[0])
    try:
        section = family.model_section(config)
    except KeyError as err:
        raise CheckpointError(f"config.json ({family.architecture}) lacks {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"config.json ({family.architecture}) holds a value of the wrong type: {err}") from None
    return {key: section[key] for key in MODEL_DEFAULTS if key in section}  # docs/config.md's order
