"""Llama (LlamaForCausalLM: Llama 2, 3, 3.1, 3.2, SmolLM2, ...) and the Llama-shaped decoder's HF names and tensor
layouts, which Qwen2, Qwen3 and Mistral share (`LlamaShaped`).

The layer spec: RoPE (Llama-3.1's "llama3" scaling with all four of its values), SwiGLU (megatron's fc1 is
[gate; up]), RMSNorm, grouped-query attention with any head size, biases on every linear layer or on none
(attention_bias = mlp_bias), tied or untied output. HF's q/k/v projections are separate; megatron's QKV rows are
grouped by key/value head (family.qkv_join).
"""
import torch

from pretrain.families.family import (UNREAD_KEYS, Family, complete, given_head_dim, groups, head_dim, identity,
                                      integer, qkv_join, qkv_split, rope_keys, rope_section)


def _cat(*tensors):
    return torch.cat(tensors)


class LlamaShaped(Family):
    """The Llama-shaped decoder's names and layouts: biases by `[model]` bias (every linear layer) and qkv_bias
    (QKV alone), q/k norms by qk_layernorm."""

    read_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
                 "tie_word_embeddings")
    unread_keys = {**UNREAD_KEYS, "attention_dropout": "dropout: training only (zero3d's model.attention_dropout)"}

    def _layer_names(self, model: dict) -> dict:
        """{megatron suffix: HF suffix} of one layer's tensors mapped one to one (QKV and fc1 are split apart)."""
        out = {"input_layernorm.weight": "input_layernorm.weight",
               "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
               "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
               "mlp.linear_fc2.weight": "mlp.down_proj.weight"}
        if model.get("bias"):
            out.update({"self_attention.linear_proj.bias": "self_attn.o_proj.bias",
                        "mlp.linear_fc2.bias": "mlp.down_proj.bias"})
        if model.get("qk_layernorm"):  # per-head RMSNorm of queries and keys ([head_dim]), before RoPE in both
            out.update({f"self_attention.{p}_layernorm.weight": f"self_attn.{p}_norm.weight" for p in "qk"})
        return out

    def to_hf(self, params: dict, model: dict, vocab_size: int) -> dict:
        heads, kv = model["num_attention_heads"], groups(model)
        out = {}
        for i in range(model["num_layers"]):
            src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
            out.update({dst + b: params[src + a] for a, b in self._layer_names(model).items()})
            kinds = ("weight",) + (("bias",) if model.get("bias") or model.get("qkv_bias") else ())
            for kind in kinds:
                q, k, v = qkv_split(params[f"{src}self_attention.linear_qkv.{kind}"], heads, kv)
                out.update({f"{dst}self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", (q, k, v))})
            for kind in ("weight",) + (("bias",) if model.get("bias") else ()):
                gate, up = params[f"{src}mlp.linear_fc1.{kind}"].chunk(2)
                out.update({f"{dst}mlp.gate_proj.{kind}": gate, f"{dst}mlp.up_proj.{kind}": up})
        out.update({"model.embed_tokens.weight": params["embedding.word_embeddings.weight"][:vocab_size],
                    "model.norm.weight": params["decoder.final_layernorm.weight"]})
        if not model["tie_embeddings"]:
            out["lm_head.weight"] = params["output_layer.weight"][:vocab_size]
        return {k: v.contiguous() for k, v in out.items()}

    def import_recipe(self, model: dict) -> dict:
        heads, kv = model["num_attention_heads"], groups(model)

        def join(q, k, v):
            return qkv_join(q, k, v, heads, kv)
        out = {}
        for i in range(model["num_layers"]):
            src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
            out.update({dst + a: (identity, [src + b]) for a, b in self._layer_names(model).items()})
            for kind in ("weight",) + (("bias",) if model.get("bias") or model.get("qkv_bias") else ()):
                sources = [f"{src}self_attn.{p}_proj.{kind}" for p in "qkv"]
                out[f"{dst}self_attention.linear_qkv.{kind}"] = (join, sources)
            for kind in ("weight",) + (("bias",) if model.get("bias") else ()):
                out[f"{dst}mlp.linear_fc1.{kind}"] = (_cat, [f"{src}mlp.gate_proj.{kind}", f"{src}mlp.up_proj.{kind}"])
        out.update({"embedding.word_embeddings.weight": (identity, ["model.embed_tokens.weight"]),
                    "decoder.final_layernorm.weight": (identity, ["model.norm.weight"])})
        if not model["tie_embeddings"]:
            out["output_layer.weight"] = (identity, ["lm_head.weight"])
        return out

    @staticmethod
    def decoder_section(family: Family, config: dict, kv_heads_default, head_dim_default=None) -> dict:
        """The `[model]` sizes of a Llama-shaped config.json (silu required), with its class's defaults for the
        key/value heads (None: one per head) and the head size (None: hidden // heads, as transformers takes it)."""
        if config.get("hidden_act", "silu") != "silu":
            raise family.refuse(f"hidden_act = {config.get('hidden_act')!r} is not supported; supported: 'silu' "
                                "(SwiGLU)")
        heads, hidden = integer(family, config, "num_attention_heads"), integer(family, config, "hidden_size")
        kv = config.get("num_key_value_heads", kv_heads_default)
        return {"num_layers": integer(family, config, "num_hidden_layers"), "hidden_size": hidden,
                "num_attention_heads": heads,
                "head_dim": given_head_dim(family, config, head_dim_default or hidden // heads),
                "num_query_groups": heads if kv is None else integer(family, {"num_key_value_heads": kv},
                                                                     "num_key_value_heads"),
                "ffn_hidden_size": integer(family, config, "intermediate_size"),
                "vocab_size": integer(family, config, "vocab_size"), "mlp": "swiglu", "norm": "rmsnorm",
                "norm_epsilon": float(config.get("rms_norm_eps", 1e-6))}

    @staticmethod
    def decoder_config(family: Family, model: dict, vocab_size: int) -> dict:
        """The config.json keys every Llama-shaped class reads alike."""
        return {"architectures": [family.architecture], "model_type": family.model_type, "vocab_size": vocab_size,
                "hidden_size": model["hidden_size"], "intermediate_size": complete(model)["ffn_hidden_size"]
                or 4 * model["hidden_size"], "num_hidden_layers": model["num_layers"],
                "num_attention_heads": model["num_attention_heads"], "num_key_value_heads": groups(model),
                "head_dim": head_dim(model), "max_position_embeddings": model["seq_length"],
                "rms_norm_eps": model.get("norm_epsilon", 1e-5), **rope_keys(model),
                "hidden_act": "silu", "attention_dropout": 0.0, "tie_word_embeddings": bool(model["tie_embeddings"]),
                "torch_dtype": "float32"}


def llama_shaped(model: dict) -> bool:
    """RoPE, SwiGLU and RMSNorm: the decoder every Llama-shaped family computes."""
    m = complete(model)
    return (m["position_embedding"], m["mlp"], m["norm"]) == ("rope", "swiglu", "rmsnorm")


class Llama(LlamaShaped):
    name, architecture, model_type = "Llama", "LlamaForCausalLM", "llama"
    summary = ("RoPE (default or Llama-3.1's llama3 scaling), swiglu, rmsnorm, any head size, biases on every linear "
               "layer or none, no q/k norms, no sliding window")
    read_keys = LlamaShaped.read_keys + ("head_dim", "attention_bias", "mlp_bias")
    unread_keys = {**LlamaShaped.unread_keys,
                   "pretraining_tp": "Llama 2's matmuls sliced in transformers 4.x: the same products"}

    def model_section(self, config: dict) -> dict:
        attention, mlp = config.get("attention_bias", False), config.get("mlp_bias", False)
        if attention != mlp:
            raise self.refuse(f"attention_bias = {attention!r} with mlp_bias = {mlp!r} is not supported; supported: "
                              "both or neither (megatron's bias is on every linear layer)")
        max_positions = integer(self, config, "max_position_embeddings", 2048)
        return {**self.decoder_section(self, config, None), "seq_length": max_positions,
                "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
                **rope_section(self, config, max_positions, scaling=("llama3",)),
                "bias": bool(attention), "qkv_bias": False, "qk_layernorm": False, "sliding_window": None}

    def computes(self, model: dict) -> bool:
        m = complete(model)
        return llama_shaped(m) and not (m["qk_layernorm"] or m["qkv_bias"]) and m["sliding_window"] is None

    def hf_config(self, model: dict, vocab_size: int) -> dict:
        return {**self.decoder_config(self, model, vocab_size), "attention_bias": bool(model["bias"]),
                "mlp_bias": bool(model["bias"])}


FAMILY = Llama()
