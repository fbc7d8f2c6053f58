"""Mistral (MistralForCausalLM): Llama's decoder without biases, with a sliding window (4096 by default) in every
layer, computed only where it covers the sequence (`[model]` sliding_window >= seq_length: the attention is full
causal); no window (Mistral-7B-v0.3's null) is Llama's function, exported as the Llama family's class."""
from pretrain.families.family import complete, integer, rope_section
from pretrain.families.llama import LlamaShaped, llama_shaped


class Mistral(LlamaShaped):
    name, architecture, model_type = "Mistral", "MistralForCausalLM", "mistral"
    summary = "Llama's with sliding_window set (covering the sequence), no biases, default RoPE"
    read_keys = LlamaShaped.read_keys + ("head_dim", "sliding_window")

    def model_section(self, config: dict) -> dict:
        max_positions = integer(self, config, "max_position_embeddings", 4096 * 32)
        window = config.get("sliding_window", 4096)
        window = None if window is None else integer(self, {"sliding_window": window}, "sliding_window")
        return {**self.decoder_section(self, config, 8),
                "seq_length": max_positions if window is None else min(max_positions, window),
                "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
                **rope_section(self, config, max_positions), "bias": False, "qkv_bias": False,
                "qk_layernorm": False, "sliding_window": window}

    def computes(self, model: dict) -> bool:
        m = complete(model)
        return (llama_shaped(m) and m["sliding_window"] is not None
                and not (m["bias"] or m["qkv_bias"] or m["qk_layernorm"]) and m["rope_scaling_factor"] is None)

    def hf_config(self, model: dict, vocab_size: int) -> dict:
        return {**self.decoder_config(self, model, vocab_size), "sliding_window": model["sliding_window"]}


FAMILY = Mistral()
