"""Llama-3.1's RoPE frequency scaling ("llama3") with all four of its values, set on the built model.

megatron-core 0.16.1's RotaryEmbedding applies this scaling with its factor alone: the low- and high-frequency
factors and the original context length are fixed at Meta's 1, 4 and 8192 in its constructor. So the model is built
with megatron's unscaled frequencies (the same floats as transformers': 1 / base^(2i/d) in fp32) and
`scale_rope_frequencies` replaces them, before any forward, by `llama3_frequencies` of them: transformers'
`_compute_llama3_parameters` step for step, so a published Llama-3.1 / 3.2 computes its own rotations whatever
values its config.json holds.
"""
import math

import torch


def llama3_frequencies(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                       original_max_positions: int) -> torch.Tensor:
    """The scaled inverse frequencies: wavelengths (2π / f) shorter than original / high_freq_factor kept, longer
    than original / low_freq_factor divided by `factor`, and in between a mix, linear in original / wavelength."""
    low_freq_wavelen = original_max_positions / low_freq_factor
    high_freq_wavelen = original_max_positions / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    divided = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * divided / factor + smooth * divided
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, divided)


def scale_rope_frequencies(model, m) -> None:
    """With model.rope_scaling_factor set, this rank's GPTModel rotates by the scaled frequencies (its rotary
    embedding's `inv_freq`, read at each forward; nothing cached yet): megatron's own frequencies, scaled."""
    rotary = getattr(model, "rotary_pos_emb", None)
    if m.position_embedding != "rope" or m.rope_scaling_factor is None or rotary is None:
        return
    rotary.inv_freq = llama3_frequencies(rotary.inv_freq, m.rope_scaling_factor, m.rope_scaling_low_freq_factor,
                                         m.rope_scaling_high_freq_factor, m.rope_scaling_original_max_positions)
