"""The Hugging Face format, whatever the family: zero3d's model (megatron's TP-1 names and layouts) ↔ an HF directory.

Each family's names, tensor layouts and config.json keys live in its module of pretrain/families/ (the registry
lists them); this module holds what every family shares. Export: `architecture(model)` (the one HF class that
computes a `[model]` section, or why none does), `hf_config(model, vocab)` and `to_hf(params, model, vocab)`.
Import: `ImportedModel(directory)` reads an HF directory — its config.json and safetensors only, each tensor's name,
shape and dtype checked against the config before any is read, no pickle, no remote code — as the `[model]` keys that
build the same model and megatron-named global tensors made one at a time, which `load_into` splits onto a rank's
TP/PP slice; `check_matches` holds a run's `[model]` section to it.
"""
import json
from pathlib import Path

import torch

from pretrain.errors import CheckpointError, ConfigError
from pretrain.families.registry import ARCHITECTURES, by_architecture, for_model, model_section  # noqa: F401

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def architecture(model: dict) -> str:
    """The HF class that computes what this `[model]` section does, or CheckpointError naming why none does."""
    return for_model(model).architecture


def hf_config(model: dict, vocab_size: int) -> dict:
    """The HF config.json of this `[model]` section (the tokenizer's `vocab_size` rows, padding dropped)."""
    return for_model(model).hf_config(model, vocab_size)


def to_hf(params: dict, model: dict, vocab_size: int) -> dict:
    """{HF name: tensor} of an export's {megatron name: global tensor} (TP 1 × PP 1 names)."""
    return for_model(model).to_hf(params, model, vocab_size)


# ---------------------------------------------------------------- import


def read_hf_config(directory: Path) -> dict:
    """config.json of an HF directory, JSON only; remote code (`auto_map`) and unsupported classes refused."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} cannot be read as JSON: {err}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds {type(config).__name__}, not a JSON object")
    if "auto_map" in config:
        raise CheckpointError(f"{path} names remote code (auto_map); zero3d never runs a model's own code: supported "
                              f"architectures are {', '.join(ARCHITECTURES)}")
    arch = (config.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    return config


def expected_hf_shapes(model: dict, vocab_size: int, architecture_of: str) -> dict:
    """{HF name: shape} the `[model]` section's HF state dict holds in class `architecture_of` (shapes alone, through
    its family's `to_hf` on meta tensors)."""
    from pretrain.sections import ModelConfig
    shape = ModelConfig(**{**model, "vocab_size": vocab_size, "make_vocab_size_divisible_by": 1}).shape
    meta = {name: torch.empty(dims, device="meta") for name, dims in shape.parameter_shapes().items()}
    return {name: tuple(t.shape) for name, t in by_architecture(architecture_of).to_hf(meta, model, vocab_size).items()}


def safetensors_files(directory: Path) -> list:
    """The model's safetensors files: model.safetensors, or those model.safetensors.index.json lists; a pickled
    checkpoint (pytorch_model.bin) is refused, never read."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is not a safetensors index (a weight_map): {err}") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if "/" in name or name.startswith(".") or not (directory / name).is_file():
                raise CheckpointError(f"{index} names shard {name!r}, which is missing from {directory}")
        return [directory / name for name in files]
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    pickled = [p.name for p in directory.glob("*.bin")] + [p.name for p in directory.glob("*.pt")]
    why = f" ({', '.join(sorted(pickled))} are pickles, which zero3d never loads)" if pickled else ""
    raise CheckpointError(f"{directory} holds no model.safetensors or model.safetensors.index.json{why}")


# Buffers some HF checkpoints carry beside the weights (recomputed by the model, never loaded).
IGNORED = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


class HFTensors:
    """The tensors of an HF directory's safetensors files, each checked for name, shape and dtype against what
    config.json describes before any is read, then read one at a time (`read(name)`, fp32)."""

    def __init__(self, directory: Path, expected: dict):
        from safetensors import SafetensorError, safe_open
        self.directory, self.where = Path(directory), {}
        for path in safetensors_files(directory):
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():
                        if name.endswith(IGNORED):
                            continue
                        if name not in expected:
                            raise CheckpointError(f"{path.name}: tensor {name!r} is not part of the model config.json "
                                                  "describes")
                        piece = f.get_slice(name)
                        shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
                        if shape != expected[name] or dtype not in DTYPES:
                            raise CheckpointError(f"{path.name}: tensor {name!r} is {dtype} {list(shape)}; config.json "
                                                  f"describes {list(expected[name])} (dtypes {', '.join(DTYPES)})")
                        self.where[name] = path
            except (OSError, ValueError, SafetensorError) as err:  # not a safetensors file, or a damaged one
                raise CheckpointError(f"{path} cannot be read as safetensors: {err}") from None
        missing = sorted(set(expected) - set(self.where))
        if missing:
            raise CheckpointError(f"{directory}: tensors config.json describes are missing: {', '.join(missing[:4])}"
                                  + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open
        with safe_open(str(self.where[name]), framework="pt") as f:
            return f.get_tensor(name).float()


class ImportedModel:
    """An HF directory as megatron's global tensors, made one at a time (`tensor(name)`): one tensor's bytes in
    host memory at once, whatever the model's size."""

    def __init__(self, directory: Path):
        config = read_hf_config(directory)
        self.family = by_architecture(config["architectures"][0])
        self.model = model_section(config)
        try:
            expected = expected_hf_shapes(self.model, self.model["vocab_size"], self.family.architecture)
        except ConfigError as err:  # a size no model can have (0 layers, heads not dividing hidden, ...)
            raise CheckpointError(f"{Path(directory) / 'config.json'} describes no buildable model: {err}") from None
        self.hf = HFTensors(directory, expected)
        self.recipe = self.family.import_recipe(self.model)

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.recipe:
            raise CheckpointError(f"the imported model has no tensor for parameter {name!r}")
        function, sources = self.recipe[name]
        return function(*(self.hf.read(s) for s in sources))


def load_into(model_module, imported: ImportedModel) -> None:
    """Copy the imported model's global tensors into this rank's TP/PP slice of the built model (megatron's
    sharded-state templates say where each local row lies globally); rows past a tensor's end (the padded
    vocabulary) are zero."""
    from pretrain.checkpoint.tensors import model_templates
    params = dict(model_module.named_parameters())
    with torch.no_grad():
        for name, parts in model_templates(model_module).items():
            p = params[name]
            for part in parts:
                sh = part.sh
                global_name = name
                if sh.prepend_axis_num:  # a stacked decoder layer: its global index is the key's first offset
                    head, _, tail = name.partition("decoder.layers.")
                    global_name = f"{head}decoder.layers.{sh.global_offset[0]}.{tail.split('.', 1)[1]}"
                tied = "output_layer" in name and sh.key.startswith("embedding")  # a tied output layer (last PP stage)
                source = imported.tensor("embedding.word_embeddings.weight" if tied else global_name)
                full = torch.zeros(tuple(sh.global_shape[sh.prepend_axis_num:]), dtype=source.dtype)
                full[tuple(slice(0, n) for n in source.shape)] = source
                offset = sh.global_offset[sh.prepend_axis_num:]
                box = full[tuple(slice(o, o + n) for o, n in zip(offset, sh.local_shape))]
                p[part.row:part.row + sh.local_shape[0]].copy_(box)


def toml_value(value) -> str:
    """A `[model]` value as TOML (and as a `model.key=value` override)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def model_overrides(model: dict) -> list:
    """`model.key=value` overrides that build the imported model (keys left at None are left out)."""
    return [f"model.{k}={toml_value(v)}" for k, v in model.items() if v is not None]


def check_matches(imported: dict, m, directory) -> None:
    """The run's `[model]` section builds the imported model: every key the HF config fixes agrees (RoPE leaves
    the sequence length free), else CheckpointError naming each that differs."""
    ours = {**{k: getattr(m, k) for k in imported}, "ffn_hidden_size": m.ffn_size, "num_query_groups": m.shape.groups,
            "head_dim": m.shape.head_dim}
    theirs = {**imported, "num_query_groups": imported.get("num_query_groups") or imported["num_attention_heads"],
              "head_dim": imported.get("head_dim") or imported["hidden_size"] // imported["num_attention_heads"]}
    free = {"seq_length"} if imported.get("position_embedding") == "rope" else set()
    diffs = [f"model.{k} = {ours[k]!r} (it has {v!r})" for k, v in theirs.items() if k not in free and ours[k] != v]
    if diffs:
        raise CheckpointError(f"train.init_from = {str(directory)!r} holds another model: " + "; ".join(diffs)
                              + f" (python -m pretrain.hf_config {directory} prints its [model] section)")
