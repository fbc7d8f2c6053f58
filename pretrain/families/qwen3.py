"""Qwen3 (Qwen3ForCausalLM): Llama's decoder without biases whose per-head q/k RMSNorms are megatron's q_layernorm /
k_layernorm, with its own head size (config.json's head_dim, 128 by default: heads × head_dim need not be the hidden
size, megatron's kv_channels), default RoPE, and a sliding window only where it covers the sequence."""
from pretrain.families.family import complete, integer, qwen_window, qwen_window_keys, rope_section
from pretrain.families.llama import LlamaShaped, llama_shaped


class Qwen3(LlamaShaped):
    name, architecture, model_type = "Qwen3", "Qwen3ForCausalLM", "qwen3"
    summary = "Llama's with qk_layernorm = true, no biases, any head size, default RoPE"
    read_keys = LlamaShaped.read_keys + ("head_dim", "attention_bias", "use_sliding_window", "sliding_window",
                                         "max_window_layers", "layer_types")

    def model_section(self, config: dict) -> dict:
        if config.get("attention_bias", False):
            raise self.refuse("attention_bias = true is not supported: biases on Q, K, V and the output projection "
                              "but not the MLP have no megatron layer (supported: no biases)")
        max_positions = integer(self, config, "max_position_embeddings", 32768)
        window = qwen_window(self, config, integer(self, config, "num_hidden_layers"))
        return {**self.decoder_section(self, config, 32, head_dim_default=128),
                "seq_length": max_positions if window is None else min(max_positions, window),
                "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
                **rope_section(self, config, max_positions), "bias": False, "qkv_bias": False,
                "qk_layernorm": True, "sliding_window": window}

    def computes(self, model: dict) -> bool:
        m = complete(model)
        return (llama_shaped(m) and m["qk_layernorm"] and not (m["bias"] or m["qkv_bias"])
                and m["rope_scaling_factor"] is None)

    def hf_config(self, model: dict, vocab_size: int) -> dict:
        return {**self.decoder_config(self, model, vocab_size), "attention_bias": False, **qwen_window_keys(model)}


FAMILY = Qwen3()
