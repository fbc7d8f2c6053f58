"""FLOPs of a GPT training step, model and hardware: the one formula the loop, probe, planner and benchmarks use."""
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class StepFlops:
    """One training step's matmul FLOPs, all ranks together."""

    model: int
    """Forward and backward once (backward = 2 × forward): what MFU divides, as PaLM and torchtitan define it."""
    hardware: int
    """model plus what recomputation adds: the transformer layers' whole forward (`model.recompute = "full"`), under
    selective recomputation with materialised attention its two score GEMMs (selective keeps every other GEMM's
    output), and the output layer's forward (`model.loss_recompute`): the arithmetic the GPUs performed, Megatron's
    and the ZeRO paper's TFLOP/s (HFU divides it)."""
    linears: int = 0
    """The part of `model` in the layers' QKV, projection and MLP GEMMs: what precision.fp8 runs in float8 (the
    attention scores and the logits stay bf16)."""


def layer_forward_flops_per_token(hidden: int, seq_length: int, ffn_hidden: Optional[int] = None,
                                  num_attention_heads: int = 1, num_query_groups: Optional[int] = None,
                                  gated_mlp: bool = False, head_dim: Optional[int] = None) -> int:
    """One transformer layer's forward matmul FLOPs for one token (2 per multiply-add):

      Q and output projections  2·h·(a·d) each, a heads of d = head_dim (default h / a: a·d = h)
      K and V projections       2·h·(g·d) each, g = query groups (g = heads: multi-head)
      scores QKᵀ and AV         2·s·(a·d) each (the whole s × s matrix, as Megatron counts it)
      MLP                       2·h·f per matrix: two (GELU) or three (gated: SwiGLU)

    With f = 4h, multi-head, d = h / a and no gate: 24·h² + 4·s·h, Narayanan et al. 2021's 24·h²·(1 + s/(6h)).
    Softmax, norms, biases (the QKV-only ones too) and activations are not counted (under 1% at these shapes)."""
    groups = num_attention_heads if num_query_groups is None else num_query_groups
    d = hidden // num_attention_heads if head_dim is None else head_dim
    attention = 2 * seq_length * num_attention_heads * d * 2
    return attention + layer_linear_flops_per_token(hidden, ffn_hidden, num_attention_heads, groups, gated_mlp,
                                                    head_dim)


def layer_linear_flops_per_token(hidden: int, ffn_hidden: Optional[int] = None, num_attention_heads: int = 1,
                                 num_query_groups: Optional[int] = None, gated_mlp: bool = False,
                                 head_dim: Optional[int] = None) -> int:
    """The projections' and the MLP's share of `layer_forward_flops_per_token` (its GEMMs with weights)."""
    ffn = 4 * hidden if ffn_hidden is None else ffn_hidden
    groups = num_attention_heads if num_query_groups is None else num_query_groups
    d = hidden // num_attention_heads if head_dim is None else head_dim
    query_width, kv_width = num_attention_heads * d, groups * d
    projections = 2 * hidden * query_width * 2 + 2 * hidden * kv_width * 2
    return projections + 2 * hidden * ffn * (3 if gated_mlp else 2)


def gpt_step_flops(num_layers: int, hidden: int, seq_length: int, vocab_size: int, global_batch: int,
                   recompute: bool, ffn_hidden: Optional[int] = None, num_attention_heads: int = 1,
                   num_query_groups: Optional[int] = None, gated_mlp: bool = False,
                   head_dim: Optional[int] = None, loss_recompute: bool = False,
                   recomputed_attention: bool = False) -> StepFlops:
    """Model and hardware FLOPs of one step. `vocab_size`: the padded vocabulary (the logit GEMM's width).
    The logit layer (2·h·V a token) runs once forward and twice backward (megatron's loss, and the fused chunked
    loss, which runs its two backward GEMMs in the forward pass); `loss_recompute` (the chunked loss recomputed in
    backward) runs its forward once more. `recompute`: every layer's forward again (full); `recomputed_attention`:
    only the score GEMMs QKᵀ and AV again, 4·s·(a·d) a token a layer (selective recomputation of materialised
    attention). Integers throughout, so the counts are exact."""
    tokens = global_batch * seq_length
    layers = num_layers * layer_forward_flops_per_token(hidden, seq_length, ffn_hidden, num_attention_heads,
                                                        num_query_groups, gated_mlp, head_dim) * tokens
    logits = 2 * hidden * vocab_size * tokens
    model = 3 * (layers + logits)
    linears = 3 * num_layers * layer_linear_flops_per_token(hidden, ffn_hidden, num_attention_heads, num_query_groups,
                                                            gated_mlp, head_dim) * tokens
    d = hidden // num_attention_heads if head_dim is None else head_dim
    again = layers if recompute else 0  # model.recompute = "full": every layer's forward
    again += num_layers * 4 * seq_length * num_attention_heads * d * tokens if recomputed_attention else 0
    again += logits if loss_recompute else 0  # model.loss_recompute: the output layer's forward
    return StepFlops(model=model, hardware=model + again, linears=linears)


def gpt_flops_per_step(num_layers: int, hidden: int, seq_length: int, vocab_size: int,
                       global_batch: int, recompute: bool) -> float:
    """Hardware FLOPs of a paper-shaped step (ffn = 4h, multi-head): the paper's tables' convention,
    72·B·s·L·h²·(1 + s/(6h)) + 6·B·s·h·V without recomputation, 96·… with it."""
    return float(gpt_step_flops(num_layers, hidden, seq_length, vocab_size, global_batch, recompute).hardware)
