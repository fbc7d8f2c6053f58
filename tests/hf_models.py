"""Small random Hugging Face models built locally (no hub): a Llama and a Qwen3 with GQA and a GPT-2, odd vocabularies."""
from pathlib import Path

import torch

VOCAB = 250  # not a multiple of 128: megatron pads it (256 at TP 1 and 2), the HF model does not
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def build(kind: str, vocab: int = VOCAB, tied: bool = False):
    """A random `kind` model; `tied`: a Llama or Qwen3 whose output layer is its embedding (GPT-2's always is)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if kind == "llama":  # 6 heads in 2 key/value groups of 3, SwiGLU 80, untied
        config = LlamaConfig(vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
                             rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=tied)
        return LlamaForCausalLM(config).eval()
    if kind == "qwen3":  # the Llama's shape plus per-head q/k RMSNorms (head_dim 8), no sliding window
        from transformers import Qwen3Config, Qwen3ForCausalLM
        config = Qwen3Config(vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                             num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
                             rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=tied)
        model = Qwen3ForCausalLM(config).eval()
        with torch.no_grad():  # the norms start at ones: random weights make a q/k mix-up visible
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)
        return model
    config = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=48, n_layer=2, n_head=4, n_inner=100,
                        activation_function="gelu", bos_token_id=0, eos_token_id=0)  # tied, exact GELU
    return GPT2LMHeadModel(config).eval()


def save(kind: str, directory: Path) -> dict:
    """Save a `kind` model; returns its logits on TOKENS and its state dict."""
    model = build(kind)
    model.save_pretrained(directory)
    with torch.no_grad():
        return {"logits": model(TOKENS).logits, "state": {k: v.clone() for k, v in model.state_dict().items()}}


# The acceptance's models (tests/dist/test_families_import.py): one small random model of each published family, built from
# its own config class with what its published models have and zero3d once lacked — GPT-2's tanh GELU (gelu_new),
# Llama-3.2's llama3 RoPE scaling (every value off Meta's, so that a value ignored shows) with tied embeddings,
# Qwen2's Q/K/V biases, Qwen3's head size (4 heads × 24 over a hidden size of 64), Mistral's sliding window (covering
# the 32 tokens exactly). Weights at std 0.2 (transformers' initializer_range) so that attention, and so RoPE, moves
# the loss; every bias and norm weight random (a dropped bias or a swapped norm must show).
FAMILIES = ("gpt2", "llama", "qwen2", "qwen3", "mistral")
FAMILY_SEQ = 32
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 2.0,
               "high_freq_factor": 8.0, "original_max_position_embeddings": 256}


def family_config(kind: str, vocab: int):
    """The config of the `kind` family's small model (its transformers config class)."""
    import transformers
    llama_sizes = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                       initializer_range=0.2)
    if kind == "gpt2":
        return transformers.GPT2Config(vocab_size=vocab, n_positions=FAMILY_SEQ, n_embd=64, n_layer=2, n_head=4,
                                       activation_function="gelu_new", initializer_range=0.2, bos_token_id=0,
                                       eos_token_id=0)
    if kind == "llama":
        return transformers.LlamaConfig(**llama_sizes, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=True)
    if kind == "qwen2":
        return transformers.Qwen2Config(**llama_sizes, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                        tie_word_embeddings=True, use_sliding_window=False)
    if kind == "qwen3":
        return transformers.Qwen3Config(**llama_sizes, head_dim=24, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 1e6},
                                        tie_word_embeddings=False)
    if kind == "mistral":
        return transformers.MistralConfig(**llama_sizes, sliding_window=FAMILY_SEQ,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    raise ValueError(f"no family model {kind!r}; families: {', '.join(FAMILIES)}")


def randomise_vectors(model) -> None:
    """Every bias uniform in [-0.5, 0.5], every norm weight in [0.5, 1.5] (transformers starts them at 0 and 1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.uniform_(-0.5, 0.5)
            elif p.dim() == 1:
                p.uniform_(0.5, 1.5)


def build_family(kind: str, vocab: int):
    """The `kind` family's small random model, in eval mode."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(kind, vocab)).eval()
    randomise_vectors(model)
    return model


def family_tokens(vocab: int, samples: int = 8) -> torch.Tensor:
    """[samples, FAMILY_SEQ + 1] tokens the test chooses (no zero3d data path): inputs and next-token labels."""
    return torch.randint(0, vocab, (samples, FAMILY_SEQ + 1), generator=torch.Generator().manual_seed(7))


def hf_loss(model, tokens: torch.Tensor) -> float:
    """transformers' mean next-token cross-entropy over every token of `tokens`."""
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()
