"""The Hugging Face format: zero3d's model (megatron's TP-1 names and layouts) ↔ GPT2LMHeadModel / LlamaForCausalLM /
Qwen3ForCausalLM (a Llama without biases whose per-head q/k RMSNorms are megatron's q_layernorm / k_layernorm).

`hf_config(model, vocab)` and `to_hf(params, model, vocab)` map an export's `[model]` section and tensors to an HF
config and state dict; `ImportedModel(directory)` reads an HF directory — its config.json and safetensors only,
each tensor's name, shape and dtype checked against the config before any is read, no pickle, no remote code — as
the `[model]` keys that build the same model and megatron-named global tensors made one at a time, which
`load_into` splits onto a rank's TP/PP slice. Layouts: megatron's QKV rows are grouped by key/value head
([q of the group's heads; k; v] per group), HF's are separate (Llama) or [q; k; v] columns (GPT-2's Conv1D,
which stores weights as [in, out]); megatron's SwiGLU fc1 is [gate; up].
"""
import json
from pathlib import Path

import torch

from pretrain.errors import CheckpointError, ConfigError

# Over 400 lines: both directions of the mapping (export: hf_config, to_hf; import: HFTensors, import_recipe,
# load_into, check_matches), which share each architecture's names and QKV layouts (_layer_names, _qkv_split/_join).

GPT2 = "GPT2LMHeadModel"
LLAMA = "LlamaForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
ARCHITECTURES = (GPT2, LLAMA, QWEN3)
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def architecture(model: dict) -> str:
    """The HF class that computes what this `[model]` section does, or CheckpointError naming why none does."""
    gpt2 = {"position_embedding": "learned", "mlp": "gelu", "norm": "layernorm", "bias": True}
    llama = {"position_embedding": "rope", "mlp": "swiglu", "norm": "rmsnorm"}
    qk_norm = bool(model.get("qk_layernorm"))
    if not qk_norm and all(model.get(k) == v for k, v in gpt2.items()) \
            and model.get("num_query_groups") in (None, model["num_attention_heads"]):
        return GPT2
    if all(model.get(k) == v for k, v in llama.items()) and not model.get("rope_scaling_factor"):
        if not qk_norm:
            return LLAMA
        if not model.get("bias"):  # Qwen3's MLP has no biases (attention_bias alone would be half of model.bias)
            return QWEN3
    keys = {k: model.get(k) for k in ("position_embedding", "mlp", "norm", "bias", "num_query_groups",
                                      "rope_scaling_factor", "qk_layernorm")}
    raise CheckpointError(f"no Hugging Face architecture computes this model ({', '.join(f'{k} = {v!r}' for k, v in keys.items())}); "
                          "supported: GPT2LMHeadModel (learned positions, gelu, layernorm, bias = true, multi-head), "
                          "LlamaForCausalLM (rope without scaling, swiglu, rmsnorm) and Qwen3ForCausalLM (Llama's with "
                          "qk_layernorm = true, bias = false)")


def _layout(model: dict) -> tuple:
    """(HF class, heads, key/value groups, biases, HF name prefix) of a `[model]` section both maps read."""
    arch = architecture(model)
    heads = model["num_attention_heads"]
    return arch, heads, model.get("num_query_groups") or heads, bool(model["bias"]), \
        "transformer." if arch == GPT2 else "model."


def _qkv_split(weight: torch.Tensor, heads: int, groups: int) -> tuple:
    """megatron's grouped QKV rows → (q, k, v) rows, heads in order."""
    d = weight.shape[0] // (heads + 2 * groups)
    per = heads // groups
    grouped = weight.reshape(groups, per + 2, d, *weight.shape[1:])
    q, k, v = grouped[:, :per], grouped[:, per], grouped[:, per + 1]
    return (q.reshape(heads * d, *weight.shape[1:]), k.reshape(groups * d, *weight.shape[1:]),
            v.reshape(groups * d, *weight.shape[1:]))


def _qkv_join(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """(q, k, v) rows → megatron's rows grouped by key/value head."""
    d = q.shape[0] // heads
    rest = q.shape[1:]
    grouped = torch.cat([q.reshape(groups, heads // groups, d, *rest), k.reshape(groups, 1, d, *rest),
                         v.reshape(groups, 1, d, *rest)], dim=1)
    return grouped.reshape((heads + 2 * groups) * d, *rest)


def _layer_names(arch: str, bias: bool) -> dict:
    """{megatron suffix: HF suffix} of one layer's tensors mapped one to one (QKV and fc1 are split apart)."""
    if arch == GPT2:
        return {"input_layernorm.weight": "ln_1.weight", "input_layernorm.bias": "ln_1.bias",
                "pre_mlp_layernorm.weight": "ln_2.weight", "pre_mlp_layernorm.bias": "ln_2.bias",
                "self_attention.linear_proj.bias": "attn.c_proj.bias", "mlp.linear_fc1.bias": "mlp.c_fc.bias",
                "mlp.linear_fc2.bias": "mlp.c_proj.bias"}
    out = {"input_layernorm.weight": "input_layernorm.weight",
           "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
           "self_attention.linear_proj.weight": "self_attn.o_proj.weight", "mlp.linear_fc2.weight": "mlp.down_proj.weight"}
    if bias:
        out.update({"self_attention.linear_proj.bias": "self_attn.o_proj.bias", "mlp.linear_fc2.bias": "mlp.down_proj.bias"})
    if arch == QWEN3:  # per-head RMSNorm of queries and keys ([head_dim], norm_epsilon), before RoPE in both
        out.update({f"self_attention.{p}_layernorm.weight": f"self_attn.{p}_norm.weight" for p in "qk"})
    return out


def hf_config(model: dict, vocab_size: int) -> dict:
    """The HF config.json of this `[model]` section (the tokenizer's `vocab_size` rows, padding dropped)."""
    arch = architecture(model)
    h, heads, layers = model["hidden_size"], model["num_attention_heads"], model["num_layers"]
    ffn = model.get("ffn_hidden_size") or 4 * h
    if arch == GPT2:
        return {"architectures": [GPT2], "model_type": "gpt2", "vocab_size": vocab_size, "n_positions": model["seq_length"],
                "n_embd": h, "n_layer": layers, "n_head": heads, "n_inner": ffn, "activation_function": "gelu",
                "layer_norm_epsilon": model.get("norm_epsilon", 1e-5), "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attn_pdrop": 0.0, "tie_word_embeddings": bool(model["tie_embeddings"]), "torch_dtype": "float32"}
    config = {"architectures": [LLAMA], "model_type": "llama", "vocab_size": vocab_size, "hidden_size": h,
            "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": model.get("num_query_groups") or heads, "head_dim": h // heads,
            "max_position_embeddings": model["seq_length"], "rms_norm_eps": model.get("norm_epsilon", 1e-5),
            "rope_parameters": {"rope_theta": float(model.get("rope_base", 10000)), "rope_type": "default"},
            "hidden_act": "silu",
            "attention_bias": bool(model["bias"]), "mlp_bias": bool(model["bias"]), "attention_dropout": 0.0,
            "tie_word_embeddings": bool(model["tie_embeddings"]), "torch_dtype": "float32"}
    if arch == QWEN3:  # full attention in every layer (no sliding window); no mlp_bias key (its MLP has none)
        del config["mlp_bias"]
        config.update({"architectures": [QWEN3], "model_type": "qwen3", "use_sliding_window": False,
                       "sliding_window": None, "max_window_layers": layers, "layer_types": ["full_attention"] * layers})
    return config


def to_hf(params: dict, model: dict, vocab_size: int) -> dict:
    """{HF name: tensor} of an export's {megatron name: global tensor} (TP 1 × PP 1 names)."""
    arch, heads, groups, bias, prefix = _layout(model)
    out = {}
    names = _layer_names(arch, bias)
    for i in range(model["num_layers"]):
        src, dst = f"decoder.layers.{i}.", f"{prefix}{'h' if arch == GPT2 else 'layers'}.{i}."
        for a, b in names.items():
            out[dst + b] = params[src + a]
        q, k, v = _qkv_split(params[src + "self_attention.linear_qkv.weight"], heads, groups)
        gate_up = params[src + "mlp.linear_fc1.weight"]
        if arch == GPT2:  # Conv1D: [in, out]
            out[dst + "attn.c_attn.weight"] = torch.cat([q, k, v]).t().contiguous()
            out[dst + "attn.c_attn.bias"] = torch.cat(_qkv_split(params[src + "self_attention.linear_qkv.bias"], heads, groups))
            out[dst + "attn.c_proj.weight"] = params[src + "self_attention.linear_proj.weight"].t().contiguous()
            out[dst + "mlp.c_fc.weight"] = gate_up.t().contiguous()
            out[dst + "mlp.c_proj.weight"] = params[src + "mlp.linear_fc2.weight"].t().contiguous()
            continue
        out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k,
                    dst + "self_attn.v_proj.weight": v})
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate_up.chunk(2)
        if bias:
            qb, kb, vb = _qkv_split(params[src + "self_attention.linear_qkv.bias"], heads, groups)
            out.update({dst + "self_attn.q_proj.bias": qb, dst + "self_attn.k_proj.bias": kb,
                        dst + "self_attn.v_proj.bias": vb})
            out[dst + "mlp.gate_proj.bias"], out[dst + "mlp.up_proj.bias"] = params[src + "mlp.linear_fc1.bias"].chunk(2)
    embed = params["embedding.word_embeddings.weight"][:vocab_size]
    if arch == GPT2:
        out.update({"transformer.wte.weight": embed, "transformer.wpe.weight": params["embedding.position_embeddings.weight"],
                    "transformer.ln_f.weight": params["decoder.final_layernorm.weight"],
                    "transformer.ln_f.bias": params["decoder.final_layernorm.bias"]})
    else:
        out.update({"model.embed_tokens.weight": embed, "model.norm.weight": params["decoder.final_layernorm.weight"]})
    if not model["tie_embeddings"]:
        out["lm_head.weight"] = params["output_layer.weight"][:vocab_size]
    return {k: v.contiguous() for k, v in out.items()}


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


def model_section(config: dict) -> dict:
    """The `[model]` keys that build the HF model `config` describes; CheckpointError names a key it lacks."""
    try:
        return _model_section(config)
    except KeyError as err:
        raise CheckpointError(f"config.json ({config['architectures'][0]}) lacks {err.args[0]!r}") from None
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"config.json ({config['architectures'][0]}) holds a value of the wrong type: {err}") \
            from None


def _model_section(config: dict) -> dict:
    if config["architectures"][0] == GPT2:
        if config.get("activation_function", "gelu_new") != "gelu":
            raise CheckpointError(f"GPT-2 activation_function {config.get('activation_function', 'gelu_new')!r} is not "
                                  "supported: megatron's MLP computes exact GELU ('gelu')")
        return {"num_layers": config["n_layer"], "hidden_size": config["n_embd"], "num_attention_heads": config["n_head"],
                "ffn_hidden_size": config.get("n_inner") or 4 * config["n_embd"], "seq_length": config["n_positions"],
                "vocab_size": config["vocab_size"], "tie_embeddings": config.get("tie_word_embeddings", True),
                "norm_epsilon": config.get("layer_norm_epsilon", 1e-5)}
    heads, qwen3 = config["num_attention_heads"], config["architectures"][0] == QWEN3
    if qwen3 and (config.get("attention_bias", False) or config.get("use_sliding_window", False)
                  or any(t != "full_attention" for t in config.get("layer_types") or [])):
        raise CheckpointError(f"Qwen3 attention_bias {config.get('attention_bias')!r}, use_sliding_window "
                              f"{config.get('use_sliding_window')!r} or layer_types {config.get('layer_types')!r} is not "
                              "supported (supported: no biases, full attention in every layer)")
    if config.get("head_dim", 128 if qwen3 else config["hidden_size"] // heads) * heads != config["hidden_size"]:
        raise CheckpointError(f"head_dim {config.get('head_dim')} × {heads} heads != hidden_size {config['hidden_size']}: "
                              "megatron's attention needs hidden = heads × head size")
    rope = config.get("rope_parameters") or {}  # transformers 5; 4.x: rope_theta and rope_scaling at the top
    rope_type = rope.get("rope_type", (config.get("rope_scaling") or {}).get("rope_type", "default"))
    if rope_type != "default" or config.get("attention_bias", False) != config.get("mlp_bias", False) \
            or config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"rope type {rope_type!r}, hidden_act {config.get('hidden_act')!r} or attention_bias "
                              "differing from mlp_bias is not supported (supported: default RoPE, silu, both or no biases)")
    return {"num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"], "num_attention_heads": heads,
            "num_query_groups": config.get("num_key_value_heads") or heads, "ffn_hidden_size": config["intermediate_size"],
            "seq_length": config.get("max_position_embeddings", 2048), "vocab_size": config["vocab_size"],
            "tie_embeddings": config.get("tie_word_embeddings", False), "position_embedding": "rope",
            "rope_base": int(rope.get("rope_theta", config.get("rope_theta", 10000))), "mlp": "swiglu", "norm": "rmsnorm",
            "norm_epsilon": config.get("rms_norm_eps", 1e-6), "bias": bool(config.get("attention_bias", False)),
            "qk_layernorm": qwen3}


def expected_hf_shapes(model: dict, vocab_size: int) -> dict:
    """{HF name: shape} the `[model]` section's HF state dict holds (shapes alone, through `to_hf` on meta tensors)."""
    from pretrain.sections import ModelConfig
    shape = ModelConfig(**{**model, "vocab_size": vocab_size, "make_vocab_size_divisible_by": 1}).shape
    meta = {name: torch.empty(dims, device="meta") for name, dims in shape.parameter_shapes().items()}
    return {name: tuple(t.shape) for name, t in to_hf(meta, model, vocab_size).items()}


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


def _cat(*tensors):
    return torch.cat(tensors)


def _t(tensor):
    return tensor.t()


def _gpt2_qkv(heads: int):
    return lambda c_attn: _qkv_join(*c_attn.t().chunk(3), heads, heads)


def _gpt2_qkv_bias(heads: int):
    return lambda bias: _qkv_join(*bias.chunk(3), heads, heads)


def import_recipe(model: dict) -> dict:
    """{megatron TP-1 name: (function, [HF names])}: how each global tensor is made from the HF tensors."""
    arch, heads, groups, bias, prefix = _layout(model)
    out = {}
    for i in range(model["num_layers"]):
        src, dst = f"{prefix}{'h' if arch == GPT2 else 'layers'}.{i}.", f"decoder.layers.{i}."
        out.update({dst + a: (lambda x: x, [src + b]) for a, b in _layer_names(arch, bias).items()})
        if arch == GPT2:
            out[dst + "self_attention.linear_qkv.weight"] = (_gpt2_qkv(heads), [src + "attn.c_attn.weight"])
            out[dst + "self_attention.linear_qkv.bias"] = (_gpt2_qkv_bias(heads), [src + "attn.c_attn.bias"])
            out[dst + "self_attention.linear_proj.weight"] = (_t, [src + "attn.c_proj.weight"])
            out[dst + "mlp.linear_fc1.weight"] = (_t, [src + "mlp.c_fc.weight"])
            out[dst + "mlp.linear_fc2.weight"] = (_t, [src + "mlp.c_proj.weight"])
            continue
        join = lambda q, k, v: _qkv_join(q, k, v, heads, groups)  # noqa: E731
        for kind in ("weight",) + (("bias",) if bias else ()):
            out[dst + f"self_attention.linear_qkv.{kind}"] = (join, [src + f"self_attn.{p}_proj.{kind}" for p in "qkv"])
            out[dst + f"mlp.linear_fc1.{kind}"] = (_cat, [src + f"mlp.gate_proj.{kind}", src + f"mlp.up_proj.{kind}"])
    if arch == GPT2:
        out.update({"embedding.word_embeddings.weight": (lambda x: x, ["transformer.wte.weight"]),
                    "embedding.position_embeddings.weight": (lambda x: x, ["transformer.wpe.weight"]),
                    "decoder.final_layernorm.weight": (lambda x: x, ["transformer.ln_f.weight"]),
                    "decoder.final_layernorm.bias": (lambda x: x, ["transformer.ln_f.bias"])})
    else:
        out.update({"embedding.word_embeddings.weight": (lambda x: x, ["model.embed_tokens.weight"]),
                    "decoder.final_layernorm.weight": (lambda x: x, ["model.norm.weight"])})
    if not model["tie_embeddings"]:
        out["output_layer.weight"] = (lambda x: x, ["lm_head.weight"])
    return out


class ImportedModel:
    """An HF directory as megatron's global tensors, made one at a time (`tensor(name)`): one tensor's bytes in
    host memory at once, whatever the model's size."""

    def __init__(self, directory: Path):
        config = read_hf_config(directory)
        self.model = {"position_embedding": "learned", "mlp": "gelu", "norm": "layernorm", "bias": True,
                      "qk_layernorm": False, "num_query_groups": None, "rope_scaling_factor": None,
                      **model_section(config)}
        try:
            expected = expected_hf_shapes(self.model, self.model["vocab_size"])
        except ConfigError as err:  # a size no model can have (0 layers, heads not dividing hidden, ...)
            raise CheckpointError(f"{Path(directory) / 'config.json'} describes no buildable model: {err}") from None
        self.hf = HFTensors(directory, expected)
        self.recipe = import_recipe(self.model)

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
    ours = {**{k: getattr(m, k) for k in imported}, "ffn_hidden_size": m.ffn_size, "num_query_groups": m.shape.groups}
    theirs = {**imported, "num_query_groups": imported.get("num_query_groups") or imported["num_attention_heads"]}
    free = {"seq_length"} if imported.get("position_embedding") == "rope" else set()
    diffs = [f"model.{k} = {ours[k]!r} (it has {v!r})" for k, v in theirs.items() if k not in free and ours[k] != v]
    if diffs:
        raise CheckpointError(f"train.init_from = {str(directory)!r} holds another model: " + "; ".join(diffs)
                              + f" (python -m pretrain.hf_config {directory} prints its [model] section)")
