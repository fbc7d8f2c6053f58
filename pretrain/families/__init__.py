"""The published model families (GPT-2, Llama, Qwen2, Qwen3, Mistral): each one module, listed in registry.py."""
