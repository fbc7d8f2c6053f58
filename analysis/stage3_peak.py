"""Stage 3's peak: of the moments of a step that hold the most beside the parameters and optimizer states — the loss,
the last layer's backward and the end of the first layer's — the largest (docs/estimator.md, Stage 3's moments)."""
from dataclasses import dataclass

from model_shape.gpt import GPTShape


@dataclass(frozen=True)
class Moment:
    """What a stage-3 rank holds at one moment of its step beside its parameters, optimizer states and masks."""

    name: str
    grads: float  # of the gradient shard: the units' shards allocated by then
    checkpoints: float  # recomputation checkpoints (selective: the kept GEMM outputs) still held
    working: float  # layer activations besides them (at the loss: the final norm's input and output too)
    loss: float  # the loss's logits and the fused loss's kept gradients
    buffers: float  # temporary buffers (estimate.buffer_terms; at the loss, the gathered output layer)

    @property
    def total(self) -> float:
        return self.grads + self.checkpoints + self.working + self.loss + self.buffers


def final_norm_bytes(shape: GPTShape, tokens: int, tp: int, act_bytes: int, sequence_parallel: bool) -> int:
    """The final norm's input (the last layer's output) and output (the output layer's input), kept for backward at
    the loss: 2·tokens·h·e, over the TP ranks' tokens with sequence parallelism."""
    return 2 * tokens * shape.hidden * act_bytes // (tp if sequence_parallel else 1)


def stage3_moments(shape: GPTShape, tp: int, grad: float, late_shard: bool, checkpoints: float, working: float,
                   recompute: str, loss: float, final_norm: float, buffers: float, output_unit: float) -> tuple:
    """(the loss, the last layer's backward, the end of the first layer's) as Moments, `late_shard` when each unit's
    gradient shard exists only from its own first reduced bucket piece (Step.grad_shard_per_step, on the device),
    else all of `grad` is held throughout:

    - the loss (the fused loss's forward, megatron's loss's backward): no shard yet; every checkpoint (and, without
      recomputation, every layer's activations; no layer is recomputed yet), the final norm's tensors, the whole
      `loss` (its logits and kept gradients) and the output layer's gathered unit (`output_unit`);
    - the last layer's backward: the output layer's and the last layer's shards, G·(V_pad·h/t + layer)/Ψ, every
      checkpoint, the layer's working set and the four buffers (the loss's memory freed);
    - the end of the first layer's backward: every shard but the embedding's and the first layer's,
      G·(1 − (embedding + layer)/Ψ), the first layer's checkpoint and working set (without recomputation: its
      activations, 1/L of them), the buffers as at the last layer (they cover the unit end's own transients, its
      bucket's join and the activation gradients not yet freed: tests/unit/test_probe.py)."""
    psi = shape.params(tp)
    layer, layers = shape.layer_params(tp), shape.layers
    last_held = grad * (shape.padded_vocab(tp) * shape.hidden // tp + layer) / psi if late_shard else grad
    first_held = grad * (psi - shape.embedding_params(tp) - layer) / psi if late_shard else grad
    none = recompute == "none"
    return (Moment("the loss", 0.0 if late_shard else grad, checkpoints, (working if none else 0.0) + final_norm, loss,
                   output_unit),
            Moment("the last layer's backward", last_held, checkpoints, working, 0.0, buffers),
            Moment("the end of the first layer's backward", first_held, checkpoints / layers,
                   working / layers if none else working, 0.0, buffers))


def stage3_peak(*moments: Moment) -> Moment:
    """The moment holding the most (the earlier one of equals)."""
    return max(moments, key=lambda m: m.total)
