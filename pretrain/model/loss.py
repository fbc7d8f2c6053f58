"""The output layer and megatron's vocab-parallel cross-entropy in token chunks: no full [tokens × vocab/TP] fp32 logits.

`chunked_loss` computes what `GPTModel` computes with labels — `output_layer` then
`vocab_parallel_cross_entropy` — `model.loss_chunk_tokens` tokens at a time; each chunk's logits are
recomputed in backward (torch's non-reentrant checkpoint), so at most one chunk's fp32 logits (and its
softmax) exist at once, for one more output-layer matmul per step. The seam: `ChunkedLossGPTModel` hands
the labels to its output layer (a `ChunkedLossOutputLayer`, the same ColumnParallelLinear with its
parameters and hooks untouched) which returns the per-token loss instead of logits; megatron's
`compute_language_model_loss` then only transposes it. ZeRO stage 3's gather hooks on the output layer
therefore hold its weight for the whole computation, and re-gather it in backward before the recomputation.
"""
import torch
import megatron_patches.lean  # noqa: F401  (megatron-core without its unused torch.compile/wandb set-up)
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region)


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, bias, labels: torch.Tensor, chunk_tokens: int,
                 sequence_parallel: bool, tp_group) -> torch.Tensor:
    """Per-token loss [s, b] of hidden states [s (/TP under SP), b, h] through `weight` [vocab/TP, h] (and
    `bias`) against `labels` [s, b], as ColumnParallelLinear + vocab_parallel_cross_entropy compute it."""
    tp = tp_group.size() if tp_group is not None else 1
    if sequence_parallel and tp > 1:  # every TP rank needs the whole sequence (its backward: reduce-scatter)
        hidden = gather_from_sequence_parallel_region(hidden, group=tp_group)
    elif tp > 1:  # identity forward, input gradient summed over TP in backward
        hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    s, b, h = hidden.shape
    flat, targets = hidden.reshape(s * b, h), labels.reshape(s * b)
    if s * b <= chunk_tokens:
        return _chunk(flat, weight, bias, targets).view(s, b)
    pieces = [torch.utils.checkpoint.checkpoint(_chunk, flat[i:i + chunk_tokens], weight, bias,
                                                targets[i:i + chunk_tokens], use_reentrant=False)
              for i in range(0, s * b, chunk_tokens)]
    return torch.cat(pieces).view(s, b)


def _chunk(hidden, weight, bias, targets):
    logits = torch.matmul(hidden, weight.t())
    if bias is not None:
        logits = logits + bias
    return tensor_parallel.vocab_parallel_cross_entropy(logits.unsqueeze(1), targets.unsqueeze(1)).squeeze(1)


class ChunkedLossOutputLayer(ColumnParallelLinear):
    """GPTModel's output layer that, while `labels` is set, returns (per-token loss [s, b], None) from
    `chunked_loss` instead of (logits, bias); otherwise (no labels: logits wanted) megatron's forward."""
    labels = None
    chunk_tokens = 0

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if self.labels is None:
            return super().forward(input_, weight=weight, runtime_gather_output=runtime_gather_output)
        weight = self.weight if weight is None else weight
        bias = self.bias if not self.skip_bias_add else None
        return chunked_loss(input_, weight, bias, self.labels, self.chunk_tokens, self.sequence_parallel,
                            self.tp_group), None


class ChunkedLossGPTModel(GPTModel):
    """megatron's GPTModel whose loss (forward with labels) comes from `chunked_loss`, `chunk_tokens` at a time."""

    def __init__(self, *args, chunk_tokens: int, **kwargs):
        super().__init__(*args, **kwargs)
        if self.config.mtp_num_layers is not None:
            raise ValueError("model.loss_chunk_tokens > 0 does not cover multi-token prediction; set it to 0")
        if self.post_process:
            # The constructed ColumnParallelLinear becomes its loss-computing subclass: same object,
            # parameters, tags and hooks (a subclass adding one forward branch and no state).
            self.output_layer.__class__ = ChunkedLossOutputLayer
            self.output_layer.chunk_tokens = chunk_tokens

    def forward(self, *args, labels=None, **kwargs):
        if labels is None or not self.post_process:
            return super().forward(*args, labels=labels, **kwargs)
        self.output_layer.labels = labels.transpose(0, 1).contiguous()  # [b, s] -> [s, b], as megatron's loss
        try:
            return super().forward(*args, labels=labels, **kwargs)
        finally:
            self.output_layer.labels = None

    def compute_language_model_loss(self, labels, logits):
        """`logits` is already the per-token loss [s, b] from the output layer: [b, s], as megatron returns."""
        if self.output_layer.labels is None:
            return super().compute_language_model_loss(labels, logits)
        return logits.transpose(0, 1).contiguous()
