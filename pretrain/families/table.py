"""docs/families.md's table of published models, made from their config.json through the registry: for each, the
family that imports it (and what of it zero3d's `[model]` keys carry) or the one line that refuses it, and its
parameters as the `[model]` section counts them (GPTShape, no vocabulary padding)."""
from pretrain.errors import CheckpointError, ConfigError
from pretrain.families.registry import by_architecture, for_model, model_section
from pretrain.sections import ModelConfig

HEADER = ("| model | class | layers × hidden, heads (KV) × head size | vocabulary | parameters | model.seq_length "
          "| zero3d |\n| --- | --- | --- | --- | --- | --- | --- |")


def verdict(config: dict, seq_length: int) -> tuple:
    """(the built ModelConfig or None, "imported: ..." or "refused: <the one line>") of a config.json for a run
    of `seq_length` tokens."""
    try:
        section = model_section(config)
        m = ModelConfig(**{**section, "seq_length": seq_length, "make_vocab_size_divisible_by": 1})
    except (CheckpointError, ConfigError) as err:
        return None, f"refused: {err}"
    family, exported = by_architecture(config["architectures"][0]), for_model(section)
    again = "" if exported is family else f"; exported as {exported.architecture} (the same function)"
    return m, f"imported as {family.name}: {carried(m)}{again}"


def carried(m: ModelConfig) -> str:
    """What of the published model the `[model]` keys carry beyond sizes and a plain Llama's choices."""
    notes = []
    if m.mlp == "gelu_tanh":
        notes.append('mlp = "gelu_tanh" (gelu_new)')
    if m.rope_scaling_factor is not None:
        notes.append(f"llama3 RoPE scaling (factor {m.rope_scaling_factor:g}, low/high frequency factors "
                     f"{m.rope_scaling_low_freq_factor:g}/{m.rope_scaling_high_freq_factor:g}, original "
                     f"{m.rope_scaling_original_max_positions} positions)")
    if m.qkv_bias:
        notes.append("qkv_bias = true")
    if m.head_dim is not None and m.head_dim * m.num_attention_heads != m.hidden_size:
        notes.append(f"head_dim = {m.head_dim} ({m.num_attention_heads} × {m.head_dim} ≠ {m.hidden_size})")
    if m.qk_layernorm:
        notes.append("q/k norms")
    if m.sliding_window is not None:
        notes.append(f"sliding_window = {m.sliding_window} (covers the {m.seq_length} tokens)")
    notes.append("tied embeddings" if m.tie_embeddings else "untied output layer")
    return ", ".join(notes)


def row(name: str, config: dict, seq_length: int) -> str:
    m, said = verdict(config, seq_length)
    arch = (config.get("architectures") or ["?"])[0]
    if m is None:
        return f"| {name} | {arch} | | {config.get('vocab_size', '')} | | {seq_length} | {said} |"
    shape = m.shape
    sizes = (f"{m.num_layers} × {m.hidden_size}, {m.num_attention_heads} ({shape.groups}) × {shape.head_dim}")
    return (f"| {name} | {arch} | {sizes} | {m.vocab_size} | {shape.params():,} | {seq_length} | {said} |")


def published_table(published: dict) -> str:
    """The markdown table of {name: (config.json, seq_length)}."""
    return "\n".join([HEADER] + [row(name, config, seq) for name, (config, seq) in published.items()])
