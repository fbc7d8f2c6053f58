"""What a model family is — one Hugging Face architecture, one module of pretrain/families/ — and what the families
share: the one-line refusal, config.json's integers, the QKV layouts, RoPE's and the sliding window's keys.

A family module defines FAMILY, a `Family` stating
- its `[model]` keys and checks (`model_section`): the keys that build the model an HF config.json describes; a key
  config.json leaves out is taken at its config class's default (transformers 5.24), and a value megatron's model
  would compute differently is refused in one line (CheckpointError) naming it and what is supported;
- its layer-spec choices (`computes`): which `[model]` sections are its class's function, so that an export finds
  the one class that computes a run's model (`summary` says which, in words);
- its HF names and tensor layouts: `hf_config` and `to_hf` (export), `import_recipe` (import: {megatron TP-1 name:
  (function, [HF names])}).
The registry (registry.py) lists the families; the HF import and export (pretrain/checkpoint/hf.py),
`python -m pretrain.hf_config` and docs/families.md's table read it.
"""
import abc
import dataclasses
from typing import Optional

import torch

from pretrain.errors import CheckpointError
from pretrain.sections import ModelConfig

MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
# config.json keys no family's function reads: {key: why}
UNREAD_KEYS = {"initializer_range": "the initialisation of weights a checkpoint does not hold",
               "bos_token_id": "generation", "eos_token_id": "generation", "pad_token_id": "generation",
               "use_cache": "generation's key/value cache"}
# The [model] keys that choose the decoder's function beyond its sizes, in the order a refusal names them.
ARCHITECTURE_KEYS = ("position_embedding", "mlp", "norm", "bias", "qkv_bias", "qk_layernorm", "num_query_groups",
                     "head_dim", "rope_scaling_factor", "sliding_window")


class Family(abc.ABC):
    """One Hugging Face causal-LM class as zero3d's megatron GPTModel computes it."""

    name: str
    """As people call it (GPT-2, Llama, ...)."""
    architecture: str
    """config.json's `architectures[0]`: the transformers class."""
    model_type: str
    """config.json's `model_type`."""
    summary: str
    """The `[model]` sections it computes, in words (a refusal and docs/families.md quote it)."""
    read_keys: tuple
    """The config.json keys `model_section` reads (beyond `architectures`)."""
    unread_keys: dict
    """{config.json key: why it does not change the function}: every other key of its transformers config class."""

    @abc.abstractmethod
    def model_section(self, config: dict) -> dict:
        """The `[model]` keys that build the model `config` (its config.json) describes; CheckpointError names a
        value megatron's model would compute differently, KeyError a key it needs and lacks."""

    @abc.abstractmethod
    def computes(self, model: dict) -> bool:
        """Whether this class computes the `[model]` section `model` (keys it lacks at ModelConfig's defaults)."""

    @abc.abstractmethod
    def hf_config(self, model: dict, vocab_size: int) -> dict:
        """config.json of `model` (the tokenizer's `vocab_size` rows: the padding dropped)."""

    @abc.abstractmethod
    def to_hf(self, params: dict, model: dict, vocab_size: int) -> dict:
        """{HF name: tensor} of {megatron TP-1 name: global tensor}."""

    @abc.abstractmethod
    def import_recipe(self, model: dict) -> dict:
        """{megatron TP-1 name: (function, [HF names])}: how each global tensor is made from the HF tensors."""

    def refuse(self, message: str) -> CheckpointError:
        """The one-line refusal of a config.json value, naming the class."""
        return CheckpointError(f"config.json ({self.architecture}): {message}")


def complete(model: dict) -> dict:
    """A `[model]` section with every key it lacks (an older checkpoint's) at ModelConfig's default."""
    return {**MODEL_DEFAULTS, **model}


def head_dim(model: dict) -> int:
    """The head size: model.head_dim, or hidden / heads."""
    return model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]


def groups(model: dict) -> int:
    return model.get("num_query_groups") or model["num_attention_heads"]


def integer(family: Family, config: dict, key: str, default=None) -> int:
    """config.json's `key` as a positive integer (`default` where it is absent), or a one-line refusal."""
    value = config[key] if default is None else config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value <= 0:
        raise family.refuse(f"{key} = {value!r} is not a positive integer")
    return int(value)


def given_head_dim(family: Family, config: dict, default: Optional[int] = None) -> Optional[int]:
    """The `[model]` head_dim of config.json's head_dim (null or absent: `default`, None meaning hidden / heads):
    None where it is hidden / heads."""
    value = config.get("head_dim", default)
    if value is None:
        return None
    value = integer(family, {"head_dim": value}, "head_dim")
    return None if value * config["num_attention_heads"] == config["hidden_size"] else value


def qkv_split(weight: torch.Tensor, heads: int, groups: int) -> tuple:
    """megatron's QKV rows, grouped by key/value head ([q of the group's heads; k; v] per group) → (q, k, v)
    rows, heads in order (any head size: the rows say it)."""
    d = weight.shape[0] // (heads + 2 * groups)
    per = heads // groups
    grouped = weight.reshape(groups, per + 2, d, *weight.shape[1:])
    q, k, v = grouped[:, :per], grouped[:, per], grouped[:, per + 1]
    return (q.reshape(heads * d, *weight.shape[1:]), k.reshape(groups * d, *weight.shape[1:]),
            v.reshape(groups * d, *weight.shape[1:]))


def qkv_join(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """(q, k, v) rows → megatron's rows grouped by key/value head."""
    d = q.shape[0] // heads
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(groups, heads // groups, d, *rest), k.reshape(groups, 1, d, *rest),
                         v.reshape(groups, 1, d, *rest)], dim=1)
    return grouped.reshape((heads + 2 * groups) * d, *rest)


def identity(tensor):
    return tensor


def rope_section(family: Family, config: dict, max_positions: int, scaling: tuple = ()) -> dict:
    """The `[model]` RoPE keys of config.json: `rope_parameters` (transformers 5) or `rope_theta` and `rope_scaling`
    (4.x), as transformers reads them; rope types other than "default" and those in `scaling` ("llama3": all four
    of its values) refused, as are a partial rotary factor and a base megatron's integer rotary_base cannot hold."""
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", *scaling):
        raise family.refuse(f"RoPE type {rope_type!r} is not supported; supported: "
                            + ", ".join(repr(t) for t in ("default", *scaling)))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise family.refuse(f"partial_rotary_factor = {partial!r} is not supported: RoPE rotates every head dimension")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0 or theta != int(theta):
        raise family.refuse(f"rope_theta = {theta!r} is not supported: model.rope_base (megatron's rotary_base) is a "
                            "positive integer")
    out = {"position_embedding": "rope", "rope_base": int(theta), "rope_scaling_factor": None}
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if params.get(k) is None]
        if missing:
            raise family.refuse(f"RoPE type 'llama3' lacks {', '.join(missing)}")
        # transformers: a top-level original_max_position_embeddings first, then the RoPE parameters', then the
        # model's maximum positions
        original = config.get("original_max_position_embeddings",
                              params.get("original_max_position_embeddings", max_positions))
        out.update(rope_scaling_factor=float(params["factor"]),
                   rope_scaling_low_freq_factor=float(params["low_freq_factor"]),
                   rope_scaling_high_freq_factor=float(params["high_freq_factor"]),
                   rope_scaling_original_max_positions=integer(family, {"original": original}, "original"))
    return out


def rope_keys(model: dict) -> dict:
    """config.json's RoPE keys of a `[model]` section: `rope_parameters` (transformers 5), and the same as 4.x reads
    them, a top-level `rope_theta` and (scaled) `rope_scaling` (5 reads them alike beside rope_parameters)."""
    parameters = rope_parameters(model)
    legacy = {"rope_theta": parameters["rope_theta"]}
    if parameters["rope_type"] != "default":
        legacy["rope_scaling"] = {k: v for k, v in parameters.items() if k != "rope_theta"}
    return {"rope_parameters": parameters, **legacy}


def rope_parameters(model: dict) -> dict:
    """config.json's `rope_parameters` (transformers 5) of a `[model]` section's RoPE keys."""
    out = {"rope_theta": float(model.get("rope_base") or 10000), "rope_type": "default"}
    if model.get("rope_scaling_factor") is not None:
        m = complete(model)
        out.update(rope_type="llama3", factor=float(m["rope_scaling_factor"]),
                   low_freq_factor=float(m["rope_scaling_low_freq_factor"]),
                   high_freq_factor=float(m["rope_scaling_high_freq_factor"]),
                   original_max_position_embeddings=int(m["rope_scaling_original_max_positions"]))
    return out


def qwen_window(family: Family, config: dict, layers: int) -> Optional[int]:
    """Qwen2's and Qwen3's sliding window as `[model]` sliding_window: off unless use_sliding_window; then in the
    layers layer_types marks "sliding_attention" (by default those from max_window_layers on). A window in some
    layers only is refused (model.sliding_window windows all or none); whether it covers the sequence is
    model.sliding_window's own check."""
    if not config.get("use_sliding_window", False):
        return None
    window = config.get("sliding_window", 4096)
    if window is None:
        return None
    first = config.get("max_window_layers", 28)
    types = config.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                          for i in range(layers)]
    if not set(types) <= {"full_attention", "sliding_attention"} or len(types) != layers:
        raise family.refuse(f"layer_types = {types!r} is not supported; supported: {layers} of 'full_attention' "
                            "or 'sliding_attention'")
    windowed = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if windowed and len(windowed) != layers:
        raise family.refuse(f"a sliding window of {window} in layers {windowed[0]}-{windowed[-1]} only is not "
                            "supported; supported: the window in every layer or in none")
    return integer(family, {"sliding_window": window}, "sliding_window") if windowed else None


def qwen_window_keys(model: dict) -> dict:
    """Qwen2's and Qwen3's config.json keys of a `[model]` sliding_window: in every layer, or off."""
    layers, window = model["num_layers"], model.get("sliding_window")
    return {"use_sliding_window": window is not None, "sliding_window": window,
            "max_window_layers": 0 if window is not None else layers,
            "layer_types": ["sliding_attention" if window is not None else "full_attention"] * layers}
