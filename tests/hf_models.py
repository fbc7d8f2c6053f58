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
