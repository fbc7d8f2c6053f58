"""The config.json of published models, as their Hugging Face repositories publish them (transcribed here: nothing is
downloaded), for the families' tests and docs/families.md's table. Keys that only generation or other tooling reads
(bos/eos ids, torch_dtype, transformers_version, use_cache, task_specific_params) are kept where the files have them:
the import must read past them."""

GPT2_124M = {  # openai-community/gpt2
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1, "bos_token_id": 50256,
    "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
    "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
    "summary_type": "cls_index", "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}}, "vocab_size": 50257}

LLAMA_32_1B = {  # meta-llama/Llama-3.2-1B
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}

LLAMA_32_3B = {**LLAMA_32_1B, "head_dim": 128, "hidden_size": 3072, "num_attention_heads": 24,  # ...Llama-3.2-3B
               "num_hidden_layers": 28}

LLAMA_31_8B = {  # meta-llama/Llama-3.1-8B
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}

SMOLLM2_135M = {  # HuggingFaceTB/SmolLM2-135M
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 0, "hidden_act": "silu", "hidden_size": 576, "initializer_range": 0.041666666666666664,
    "intermediate_size": 1536, "is_llama_config": True, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True,
    "vocab_size": 49152}

QWEN25_05B = {  # Qwen/Qwen2.5-0.5B
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.40.1",
    "use_cache": True, "use_mrope": False, "use_sliding_window": False, "vocab_size": 151936}

QWEN3_06B = {  # Qwen/Qwen3-0.6B: 16 heads × 128 over a hidden size of 1024
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}

QWEN3_17B = {**QWEN3_06B, "hidden_size": 2048, "intermediate_size": 6144}  # Qwen/Qwen3-1.7B: 16 × 128 = hidden
QWEN3_4B = {**QWEN3_06B, "hidden_size": 2560, "intermediate_size": 9728, "max_window_layers": 36,  # Qwen/Qwen3-4B
            "num_attention_heads": 32, "num_hidden_layers": 36}
QWEN3_32B = {**QWEN3_06B, "hidden_size": 5120, "intermediate_size": 25600, "max_window_layers": 64,  # Qwen/Qwen3-32B
             "num_attention_heads": 64, "num_hidden_layers": 64, "tie_word_embeddings": False}

MISTRAL_7B_V01 = {  # mistralai/Mistral-7B-v0.1: a sliding window of 4096
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000}

MISTRAL_7B_V03 = {  # mistralai/Mistral-7B-v0.3: no window
    **MISTRAL_7B_V01, "attention_dropout": 0.0, "rope_theta": 1000000.0, "sliding_window": None,
    "transformers_version": "4.42.0.dev0", "vocab_size": 32768}

# Qwen2.5-7B-Instruct as its model card has users edit it for contexts beyond 32K (YaRN)
QWEN25_7B_YARN = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064}

PHI3_MINI = {  # microsoft/Phi-3-mini-4k-instruct (its class and sizes: the class alone decides)
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
    "num_attention_heads": 32, "num_hidden_layers": 32, "vocab_size": 32064}

# name → (config.json, model.seq_length of the run the row speaks of)
PUBLISHED = {
    "GPT-2 (124M)": (GPT2_124M, 1024),
    "Llama-3.2-1B": (LLAMA_32_1B, 8192),
    "Llama-3.2-3B": (LLAMA_32_3B, 8192),
    "Llama-3.1-8B": (LLAMA_31_8B, 8192),
    "SmolLM2-135M": (SMOLLM2_135M, 8192),
    "Qwen2.5-0.5B": (QWEN25_05B, 32768),
    "Qwen3-0.6B": (QWEN3_06B, 40960),
    "Qwen3-1.7B": (QWEN3_17B, 40960),
    "Qwen3-4B": (QWEN3_4B, 40960),
    "Qwen3-32B": (QWEN3_32B, 40960),
    "Mistral-7B-v0.1": (MISTRAL_7B_V01, 4096),
    "Mistral-7B-v0.1 at 8192 tokens": (MISTRAL_7B_V01, 8192),
    "Mistral-7B-v0.3": (MISTRAL_7B_V03, 32768),
    "Qwen2.5-7B-Instruct with YaRN": (QWEN25_7B_YARN, 32768),
    "Phi-3-mini-4k-instruct": (PHI3_MINI, 4096),
}
