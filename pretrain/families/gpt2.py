"""GPT-2 (GPT2LMHeadModel): learned positions, a GELU MLP — exact ("gelu") or GPT-2's own tanh approximation
("gelu_new", as every published GPT-2 has it: `[model]` mlp = "gelu_tanh") —, LayerNorm, biases, multi-head
attention, the head tied by default. HF's Conv1D stores weights as [in, out] and its c_attn's columns are [q; k; v];
megatron's QKV rows are grouped by head (family.qkv_join)."""
import torch

from pretrain.families.family import UNREAD_KEYS, Family, complete, identity, integer, qkv_join, qkv_split

# config.json's activation_function → model.mlp, each checked against transformers' ACT2FN in tests/unit/test_families.py
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
EXPORTED_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_new"}


def _t(tensor):
    return tensor.t()


def _qkv(heads: int):
    return lambda c_attn: qkv_join(*c_attn.t().chunk(3), heads, heads)


def _qkv_bias(heads: int):
    return lambda bias: qkv_join(*bias.chunk(3), heads, heads)


LAYER_NAMES = {"input_layernorm.weight": "ln_1.weight", "input_layernorm.bias": "ln_1.bias",
               "pre_mlp_layernorm.weight": "ln_2.weight", "pre_mlp_layernorm.bias": "ln_2.bias",
               "self_attention.linear_proj.bias": "attn.c_proj.bias", "mlp.linear_fc1.bias": "mlp.c_fc.bias",
               "mlp.linear_fc2.bias": "mlp.c_proj.bias"}  # {megatron suffix: HF suffix} mapped one to one


class GPT2(Family):
    name, architecture, model_type = "GPT-2", "GPT2LMHeadModel", "gpt2"
    summary = "learned positions, gelu or gelu_tanh, layernorm, bias = true, multi-head"
    read_keys = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
                 "layer_norm_epsilon", "tie_word_embeddings", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
                 "add_cross_attention")
    unread_keys = {**UNREAD_KEYS, **{k: "dropout: training only (zero3d's model.*_dropout)"
                                     for k in ("attn_pdrop", "embd_pdrop", "resid_pdrop")},
                   **{k: "the sequence-summary head of GPT2DoubleHeadsModel, not the causal LM's"
                      for k in ("summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
                                "summary_first_dropout")},
                   "reorder_and_upcast_attn": "attention scores upcast to fp32 in half precision: the same function"}

    def model_section(self, config: dict) -> dict:
        activation = config.get("activation_function", "gelu_new")
        if activation not in ACTIVATIONS:
            raise self.refuse(f"activation_function = {activation!r} is not supported; supported: "
                              + ", ".join(map(repr, ACTIVATIONS)))
        # attention scaled by 1/sqrt(head size) and nothing else; no cross-attention (a decoder alone)
        for key, supported in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                               ("add_cross_attention", False)):
            if config.get(key, supported) != supported:
                raise self.refuse(f"{key} = {config[key]!r} is not supported; supported: {supported!r}")
        hidden, inner = integer(self, config, "n_embd"), config.get("n_inner")
        return {"num_layers": integer(self, config, "n_layer"), "hidden_size": hidden,
                "num_attention_heads": integer(self, config, "n_head"), "head_dim": None, "num_query_groups": None,
                "ffn_hidden_size": 4 * hidden if inner is None else integer(self, config, "n_inner"),
                "seq_length": integer(self, config, "n_positions", 1024),
                "vocab_size": integer(self, config, "vocab_size"),
                "tie_embeddings": bool(config.get("tie_word_embeddings", True)), "position_embedding": "learned",
                "mlp": ACTIVATIONS[activation], "norm": "layernorm",
                "norm_epsilon": float(config.get("layer_norm_epsilon", 1e-5)), "bias": True, "qkv_bias": False,
                "qk_layernorm": False, "sliding_window": None}

    def computes(self, model: dict) -> bool:
        m = complete(model)
        heads = m["num_attention_heads"]
        return ((m["position_embedding"], m["norm"], m["bias"]) == ("learned", "layernorm", True)
                and m["mlp"] in EXPORTED_ACTIVATION and not (m["qk_layernorm"] or m["qkv_bias"])
                and m["num_query_groups"] in (None, heads) and m["head_dim"] in (None, m["hidden_size"] // heads)
                and m["sliding_window"] is None)

    def hf_config(self, model: dict, vocab_size: int) -> dict:
        h = model["hidden_size"]
        return {"architectures": [self.architecture], "model_type": self.model_type, "vocab_size": vocab_size,
                "n_positions": model["seq_length"], "n_embd": h, "n_layer": model["num_layers"],
                "n_head": model["num_attention_heads"], "n_inner": complete(model)["ffn_hidden_size"] or 4 * h,
                "activation_function": EXPORTED_ACTIVATION[model["mlp"]],
                "layer_norm_epsilon": model.get("norm_epsilon", 1e-5), "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attn_pdrop": 0.0, "tie_word_embeddings": bool(model["tie_embeddings"]), "torch_dtype": "float32"}

    def to_hf(self, params: dict, model: dict, vocab_size: int) -> dict:
        heads = model["num_attention_heads"]
        out = {}
        for i in range(model["num_layers"]):
            src, dst = f"decoder.layers.{i}.", f"transformer.h.{i}."
            out.update({dst + b: params[src + a] for a, b in LAYER_NAMES.items()})
            q, k, v = qkv_split(params[src + "self_attention.linear_qkv.weight"], heads, heads)
            out[dst + "attn.c_attn.weight"] = torch.cat([q, k, v]).t()  # Conv1D: [in, out]
            out[dst + "attn.c_attn.bias"] = torch.cat(qkv_split(params[src + "self_attention.linear_qkv.bias"],
                                                                heads, heads))
            out[dst + "attn.c_proj.weight"] = params[src + "self_attention.linear_proj.weight"].t()
            out[dst + "mlp.c_fc.weight"] = params[src + "mlp.linear_fc1.weight"].t()
            out[dst + "mlp.c_proj.weight"] = params[src + "mlp.linear_fc2.weight"].t()
        out.update({"transformer.wte.weight": params["embedding.word_embeddings.weight"][:vocab_size],
                    "transformer.wpe.weight": params["embedding.position_embeddings.weight"],
                    "transformer.ln_f.weight": params["decoder.final_layernorm.weight"],
                    "transformer.ln_f.bias": params["decoder.final_layernorm.bias"]})
        if not model["tie_embeddings"]:
            out["lm_head.weight"] = params["output_layer.weight"][:vocab_size]
        return {k: v.contiguous() for k, v in out.items()}

    def import_recipe(self, model: dict) -> dict:
        heads = model["num_attention_heads"]
        out = {}
        for i in range(model["num_layers"]):
            src, dst = f"transformer.h.{i}.", f"decoder.layers.{i}."
            out.update({dst + a: (identity, [src + b]) for a, b in LAYER_NAMES.items()})
            out[dst + "self_attention.linear_qkv.weight"] = (_qkv(heads), [src + "attn.c_attn.weight"])
            out[dst + "self_attention.linear_qkv.bias"] = (_qkv_bias(heads), [src + "attn.c_attn.bias"])
            out[dst + "self_attention.linear_proj.weight"] = (_t, [src + "attn.c_proj.weight"])
            out[dst + "mlp.linear_fc1.weight"] = (_t, [src + "mlp.c_fc.weight"])
            out[dst + "mlp.linear_fc2.weight"] = (_t, [src + "mlp.c_proj.weight"])
        out.update({"embedding.word_embeddings.weight": (identity, ["transformer.wte.weight"]),
                    "embedding.position_embeddings.weight": (identity, ["transformer.wpe.weight"]),
                    "decoder.final_layernorm.weight": (identity, ["transformer.ln_f.weight"]),
                    "decoder.final_layernorm.bias": (identity, ["transformer.ln_f.bias"])})
        if not model["tie_embeddings"]:
            out["output_layer.weight"] = (identity, ["lm_head.weight"])
        return out


FAMILY = GPT2()
