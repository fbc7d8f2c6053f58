"""Model states per parameter: the bytes of each precision, the optimizer's K (`OptimizerStates`, from its spec),
and the paper's per-stage formulas over them (`model_state_bytes`), generalised from 16Ψ to (2 + 2 + K)Ψ; how much of
this engine's stage-2 gradient shard a one-micro-batch step's peak holds (`late_shard_room`)."""
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

from model_shape.gpt import GPTShape
from optim import MASTER_BYTES, STATE_DTYPES, spec_named


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of each model state, and per activation element."""

    name: str
    param_bytes: int  # working copy used in forward/backward
    grad_bytes: int
    master_bytes: int  # the fp32 master copy: 4 under mixed precision, 0 in fp32 (the parameters are the master)
    activation_bytes: int


PRECISIONS = {
    "fp16": Precision("fp16", 2, 2, MASTER_BYTES, 2),
    "bf16": Precision("bf16", 2, 2, MASTER_BYTES, 2),
    "fp32": Precision("fp32", 4, 4, 0, 4),
}


@dataclass(frozen=True)
class OptimizerStates:
    """The optimizer a rank's K comes from: `optimizer.name`, `optimizer.state_dtype`, and the share of the parameters
    its spec takes whole (Muon's hidden matrices keep other states than the rest; `matrix_share_of` a shape)."""

    name: str = "adamw"
    state_dtype: str = "fp32"
    matrix_share: Fraction = Fraction(0)

    def __post_init__(self):
        spec_named(self.name)  # a bad name raises, naming the valid ones
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype = {self.state_dtype!r} is invalid; valid: {', '.join(map(repr, STATE_DTYPES))}")
        if not 0 <= self.matrix_share <= 1 or (self.matrix_share and spec_named(self.name).matrix is None):
            raise ValueError(f"matrix_share = {self.matrix_share} is invalid for {self.name}: in [0, 1], and 0 for an "
                             "optimizer that takes no matrix whole")

    def k(self, precision: str = "fp16") -> Fraction:
        """K, the paper's optimizer bytes per parameter generalised: the fp32 master (mixed precision) plus the
        spec's states, each kind of group weighted by its share of Ψ (AdamW: 4 + 8 with fp32 moments, 4 + 4 with bf16)."""
        spec = spec_named(self.name)
        states = (spec.bytes_per_element(False, self.state_dtype) * (1 - self.matrix_share)
                  + spec.bytes_per_element(True, self.state_dtype) * self.matrix_share if spec.matrix
                  else Fraction(spec.bytes_per_element(False, self.state_dtype)))
        return PRECISIONS[precision].master_bytes + states

    @property
    def elementwise_states(self) -> int:
        """States per element of the groups its spec updates elementwise (AdamW's two moments; Muon's too)."""
        return len(spec_named(self.name).states)

    @classmethod
    def of_shape(cls, shape: GPTShape, tp: int = 1, name: str = "adamw", state_dtype: str = "fp32") -> "OptimizerStates":
        """The optimizer's K for a GPT shape on one TP rank: Muon's matrix share is its hidden matrices' Ψ."""
        share = Fraction(shape.hidden_matrix_params(tp), shape.params(tp)) if spec_named(name).matrix else Fraction(0)
        return cls(name, state_dtype, share)


ADAMW_FP32 = OptimizerStates()  # the paper's K (AdamW, fp32 moments)


def model_state_bytes(params, stage: int, dp: int, precision: str = "fp16",
                      optimizer: OptimizerStates = ADAMW_FP32) -> tuple:
    """(param, grad, optimizer) bytes per GPU for ZeRO `stage` over `dp` ranks, as exact Fractions: the paper's
    (2 + 2 + K)Ψ = 16Ψ, its K generalised to `optimizer.k(precision)` (the master and the spec's states)."""
    p = PRECISIONS[precision]
    psi = Fraction(params)
    param = psi * p.param_bytes / (dp if stage >= 3 else 1)
    grad = psi * p.grad_bytes / (dp if stage >= 2 else 1)
    optimizer_bytes = psi * optimizer.k(precision) / (dp if stage >= 1 else 1)
    return param, grad, optimizer_bytes


def late_shard_room(shape: GPTShape, tp: int, bucket_elements: Optional[int], grad: float, loss: float,
                    layer: float) -> float:
    """Bytes of stage 2's gradient shard `grad` that a rank's peak does not hold when its step runs one micro-batch:
    this engine allocates each parameter group's shard whole at its first reduced bucket piece (zero3d/engine.py:
    grad_shard), when a third bucket launches with two in flight (zero3d/buckets.py): after the loss's backward, and
    after the last layer's when a layer's parameters fit in two buckets (without CB the one bucket launches after
    backward). What those free for good, `loss` and `layer` bytes (at least: a layer's activations, or a recomputed
    layer's checkpoint), makes room for it, up to `grad`. (Stage 3's shards, one a gather unit: stage3_peak.py.)"""
    whole_layer = bucket_elements is None or shape.layer_params(tp) <= 2 * bucket_elements
    return min(grad, loss + (layer if whole_layer else 0.0))
