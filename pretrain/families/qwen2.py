"""Qwen2 / Qwen2.5 (Qwen2ForCausalLM): Llama's decoder with biases on the Q, K and V projections alone (megatron's
add_qkv_bias: `[model]` qkv_bias = true, bias = false), its own head size where config.json gives one, default RoPE,
and a sliding window only where it covers the sequence (model.sliding_window: in every layer or none)."""
from pretrain.families.family import complete, integer, qwen_window, qwen_window_keys, rope_section
from pretrain.families.llama import LlamaShaped, llama_shaped


class Qwen2(LlamaShaped):
    name, architecture, model_type = "Qwen2", "Qwen2ForCausalLM", "qwen2"
    summary = "Llama's with qkv_bias = true, bias = false, default RoPE, no q/k norms"
    read_keys = LlamaShaped.read_keys + ("head_dim", "use_sliding_window", "sliding_window", "max_window_layers",
                                         "layer_types")

    def model_section(self, config: dict) -> dict:
        max_positions = integer(self, config, "max_position_embeddings", 32768)
        layers = integer(self, config, "num_hidden_layers")
        window = qwen_window(self, config, layers)
        return {**self.decoder_section(self, config, 32),
                "seq_length": max_positions if window is None else min(max_positions, window),
                "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
                **rope_section(self, config, max_positions), "bias": False, "qkv_bias": True,
                "qk_layernorm": False, "sliding_window": window}

    def computes(self, model: dict) -> bool:
        m = complete(model)
        return (llama_shaped(m) and m["qkv_bias"] and not (m["bias"] or m["qk_layernorm"])
                and m["rope_scaling_factor"] is None)

    def hf_config(self, model: dict, vocab_size: int) -> dict:
        return {**self.decoder_config(self, model, vocab_size), **qwen_window_keys(model)}


FAMILY = Qwen2()
