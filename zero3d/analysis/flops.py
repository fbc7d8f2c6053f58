"""FLOPs of a GPT training step, model and hardware: the one formula the loop, probe, planner and benchmarks use."""
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class StepFlops:
    """One training step's matmul FLOPs, all ranks together."""

    model: int
    """Forward and backward once (backward = 2 × forward): what MFU divides, as PaLM and torchtitan define it."""
    hardware: int
    """model plus what recomputation adds: the transformer layers' whole forward (`model.recompute = "full"`), or
    under selective recomputation with materialised attention its two score GEMMs (selective keeps every other
    GEMM's output): the arithmetic the GPUs performed, Megatron's and the ZeRO paper's TFLOP/s (HFU divides it)."""


def layer_forward_flops_per_token(hidden: int, seq_length: int, ffn_hidden: Optional[int] = None,
                                  num_attention_heads: int = 1, num_query_groups: Optional[int] = None,
                                  gated_mlp: bool = False) -> int:
    """One transformer layer's forward matmul FLOPs for one token (2 per multiply-add):

      Q and output projections  2·h·h each
      K and V projections       2·h·(g·d) each, d = h / heads, g = query groups (g = heads: multi-head)
      scores QKᵀ and AV         2·s·h each (the whole s × s matrix, as Megatron counts it)
      MLP                       2·h·f per matrix: two (GELU) or three (gated: SwiGLU)

    With f = 4h, multi-head and no gate: 24·h² + 4·s·h, Narayanan et al. 2021's 24·h²·(1 + s/(6h)).
    Softmax, norms, biases and activations are not counted (under 1% at these shapes)."""
    ffn = 4 * hidden if ffn_hidden is None else ffn_hidden
    groups = num_attention_heads if num_query_groups is None else num_query_groups
    kv_width = hidden // num_attention_heads * groups
    projections = 2 * hidden * hidden * 2 + 2 * hidden * kv_width * 2
    attention = 2 * seq_length * hidden * 2
    mlp = 2 * hidden * ffn * (3 if gated_mlp else 2)
    return projections + attention + mlp


def gpt_step_flops(num_layers: int, hidden: int, seq_length: int, vocab_size: int, global_batch: int,
                   recompute: bool, ffn_hidden: Optional[int] = None, num_attention_heads: int = 1,
                   num_query_groups: Optional[int] = None, gated_mlp: bool = False,
                   recomputed_attention: bool = False) -> StepFlops:
    """Model and hardware FLOPs of one step. `vocab_size`: the padded vocabulary (the logit GEMM's width);
    the logit layer (2·h·V a token) is never recomputed. `recompute`: every layer's forward again (full);
    `recomputed_attention`: only the score GEMMs QKᵀ and AV again, 4·s·h a token a layer (selective recomputation
    of materialised attention). Integers throughout, so the counts are exact."""
    tokens = global_batch * seq_length
    layers = num_layers * layer_forward_flops_per_token(hidden, seq_length, ffn_hidden, num_attention_heads,
                                                        num_query_groups, gated_mlp) * tokens
    logits = 2 * hidden * vocab_size * tokens
    model = 3 * (layers + logits)
    again = layers if recompute else num_layers * 4 * seq_length * hidden * tokens if recomputed_attention else 0
    return StepFlops(model=model, hardware=model + again)


def gpt_flops_per_step(num_layers: int, hidden: int, seq_length: int, vocab_size: int,
                       global_batch: int, recompute: bool) -> float:
    """Hardware FLOPs of a paper-shaped step (ffn = 4h, multi-head): the paper's tables' convention,
    72·B·s·L·h²·(1 + s/(6h)) + 6·B·s·h·V without recomputation, 96·… with it."""
    return float(gpt_step_flops(num_layers, hidden, seq_length, vocab_size, global_batch, recompute).hardware)
