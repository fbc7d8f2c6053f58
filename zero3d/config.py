"""The engine's settings — ZeRO and loss scaling — as dataclasses that check themselves (optimizer: optim/config.py)."""
import math
import os
from dataclasses import dataclass
from typing import Literal, Optional

from zero3d.comm.modes import CARDS, OWN_FORMAT_KEYS, CommModes

PLACEMENTS = ("none", "cpu", "nvme")
# torch._scaled_mm on CUDA takes a GEMM's contraction and output dimensions only in multiples of 16; an FP8
# linear's three GEMMs (zero3d/float8.py) contract over each of its dimensions, so every one must be.
FLOAT8_ALIGNMENT = 16


class ZeroConfigError(ValueError):
    """A zero3d setting is invalid; the message names the key, the value and what is valid."""


def _raise_first(checks) -> None:
    for ok, message in checks:
        if not ok:
            raise ZeroConfigError(message)


def _finite(section: str, obj) -> tuple:
    """(ok, message) per float field: inf or nan is never a valid setting (optimizer.lr = inf trains NaNs)."""
    return tuple((not isinstance(value, float) or math.isfinite(value),
                  f"{section}.{key} = {value} is invalid; must be a finite number")
                 for key, value in vars(obj).items())


@dataclass
class ZeroConfig:
    """What ZeRO-DP and ZeRO-R do; the TOML `[zero]` section, key for key.

    Every field is validated in `__post_init__`, so an engine built from a ZeroConfig never
    re-checks it. Build a new one (`dataclasses.replace`) to change a field after construction.
    """

    # Which model states are partitioned over the data-parallel group: 0 none (plain DP),
    # 1 optimizer states + fp32 master (Pos), 2 + gradients (Pos+g), 3 + parameters (Pos+g+p).
    stage: Literal[0, 1, 2, 3] = 0
    # CB: elements per communication bucket. Large buckets use the network well; constant size keeps
    # the staging memory independent of the model. Each bucket is one reduce-scatter and one
    # all-gather (stages 1-3), padded to a multiple of the data-parallel size.
    bucket_elements: int = 50_000_000
    # Stage 2/3: reduce-scatter each bucket while backward continues (stage 3: on a side CUDA stream
    # on GPU). Off: each bucket's reduction is waited for at once (for debugging).
    overlap_comm: bool = True
    # Stages 1/2: the parameter all-gathers after the optimizer step are waited for only just before
    # the first module using the bucket runs in the next forward; stage 3: the next units' gathers are
    # issued asynchronously (prefetch). Off: every gather completes before step()/the module returns.
    overlap_param_gather: bool = True
    # Gradients are divided by this before the data-parallel sum and by N_d / factor after it
    # (DeepSpeed's gradient_predivide_factor). 0 means N_d: the sum of N_d pre-divided fp16 gradients
    # stays in the single-rank range, so loss scaling and skipped steps do not depend on N_d.
    grad_predivide_factor: float = 0.0
    # Stage 3: parameters with at most this many elements are kept whole on every rank (not worth a
    # collective each); 0 shards everything.
    param_persistence_threshold: int = 0
    # Stage 3: how many units ahead of the running one are gathered, so gathers overlap compute.
    prefetch_units: int = 1
    # Pa: each TP rank stores 1/TP of every layer's activation checkpoint (needs full recompute).
    partition_activations: bool = False
    # Pa+cpu: those slices live in host memory (needs partition_activations).
    cpu_checkpointing: bool = False
    # MD: activation checkpoints in one pre-allocated buffer, against fragmentation.
    contiguous_checkpointing: bool = False
    # ZeRO-Offload (stages 1-3): where the fp32 master shard and Adam's moments live. "none": on the
    # device; "cpu": host memory (page-locked on CUDA), the Adam step on the CPU, and at stages 2-3 the
    # gradient shard too (each bucket's reduced piece copied down as backward produces it), as
    # ZeRO-Offload; "nvme": files under nvme_path streamed through nvme_buffer_bytes of host buffers
    # (ZeRO-Infinity), the gradient shard on the device, so host memory stays bounded.
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"
    # Stage 3: where the parameter shards live between gathers (each gather fetches them); needs
    # offload_optimizer, since the update runs where the master lives.
    offload_params: Literal["none", "cpu", "nvme"] = "none"
    # A writable directory on a fast local disk for the "nvme" placements (per-rank files, removed
    # when the process ends however it ends).
    nvme_path: str = ""
    # Host memory the NVMe optimizer stream goes through (two buffers together): a larger budget
    # means fewer, larger reads and writes; the model size does not change it.
    nvme_buffer_bytes: int = 64 * 2**20
    # ZeRO++ hpZ (stage 3): "node" keeps, after each forward all-gather, this rank's 1/m slice of the
    # gathered parameters (m = DP ranks per node), so the backward all-gather runs inside the node
    # only; costs Ψb/m more bytes per rank. "none": the backward gather spans the whole DP group.
    secondary_partition: Literal["none", "node"] = "none"
    # Hybrid sharding (stages 1-3): "node" shards the model states over the DP ranks of one node and
    # replicates them across nodes (each gradient shard all-reduced across nodes), trading memory for
    # cross-node traffic. "none": shards span the whole DP group.
    hybrid: Literal["none", "node"] = "none"
    # ZeRO++ qwZ (stage 3): "int8" sends the parameter all-gathers as block-wise int8 codes plus one
    # scale per block, dequantized on arrival (the fp32 masters stay exact). "none": unquantized.
    quantize_weights: Literal["none", "int8"] = "none"
    # ZeRO++ qgZ (stages 2-3): each bucket's gradient reduce-scatter as a hierarchical all-to-all of
    # block-wise "int8" or "int4" codes (inside the node, then across nodes), summed in fp32.
    quantize_gradients: Literal["none", "int8", "int4"] = "none"
    # Elements per quantization block (one scale each) for qwZ and qgZ; even (int4 packs two per byte).
    quant_block: int = 256
    # Stage 3 with float8 linear layers (pretrain's precision.fp8 = "tensorwise"): their weights' all-gathers move
    # float8 codes, one byte an element (half of bf16's): each weight's amax is all-reduced (max) over the shard
    # group, every rank casts its shard with that scale, and the gathered codes feed the float8 GEMMs as they are;
    # every other parameter is gathered in the model dtype. Not with secondary_partition or quantize_weights.
    fp8_gather: bool = False

    def __post_init__(self):
        checks = (
            (self.stage in (0, 1, 2, 3) and type(self.stage) is int,
             f"zero.stage = {self.stage!r} is invalid; valid values: 0, 1, 2, 3"),
            (self.bucket_elements > 0, f"zero.bucket_elements = {self.bucket_elements} must be > 0"),
            (self.grad_predivide_factor >= 0,
             f"zero.grad_predivide_factor = {self.grad_predivide_factor} must be >= 0 (0: the DP size)"),
            (self.param_persistence_threshold >= 0,
             f"zero.param_persistence_threshold = {self.param_persistence_threshold} must be >= 0"),
            (self.prefetch_units >= 0, f"zero.prefetch_units = {self.prefetch_units} must be >= 0"),
            (not self.cpu_checkpointing or self.partition_activations,
             "zero.cpu_checkpointing = true needs zero.partition_activations = true (Pa+cpu offloads "
             "the partitioned checkpoints)"),
            *self._offload_checks(),
            *self._zeropp_checks(),
        )
        _raise_first(checks)

    def comm_modes(self):
        """The node-aware communication modes these keys switch on (zero3d/comm/modes.py: one vocabulary)."""
        return CommModes.from_zero(self)

    def node_aware(self) -> bool:
        """A mode that needs the node topology of the DP group is on."""
        return self.comm_modes().node_aware

    def node_layout_error(self, per_node: int, gpus_per_node: int) -> str:
        """Why hpZ / hybrid cannot run with `per_node` DP ranks per node ("" when they can)."""
        return self.comm_modes().node_layout_error(per_node, gpus_per_node)

    def _zeropp_checks(self) -> tuple:
        """The communication modes' checks, each from its card (zero3d/comm/modes.py), and fp8_gather's."""
        z = self
        return (
            *(card.value_check(z) for card in CARDS),
            (type(z.quant_block) is int and z.quant_block > 0 and z.quant_block % 2 == 0,
             f"zero.quant_block = {z.quant_block!r} is invalid; must be an even integer > 0"),
            *(card.stage_check(z) for card in CARDS),
            *(check for card in CARDS for check in card.refusal_checks(z, of_modes=True)),
            (not z.fp8_gather or z.stage == 3,
             f"zero.fp8_gather = true needs zero.stage = 3 (only stage 3 gathers parameters); got zero.stage = {z.stage}"),
            (not z.fp8_gather or all(getattr(z, card.key) == "none" for card in CARDS if card.gathers_own_format),
             f"zero.fp8_gather = true with {OWN_FORMAT_KEYS} is refused: those modes gather the weights in their own "
             "formats; use one of them"),
            *(check for card in CARDS for check in card.refusal_checks(z, of_modes=False)),
        )

    def _offload_checks(self) -> tuple:
        z, nvme = self, "nvme" in (self.offload_optimizer, self.offload_params)
        valid = ", ".join(repr(p) for p in PLACEMENTS)
        return (
            (z.offload_optimizer in PLACEMENTS,
             f"zero.offload_optimizer = {z.offload_optimizer!r} is invalid; valid values: {valid}"),
            (z.offload_params in PLACEMENTS, f"zero.offload_params = {z.offload_params!r} is invalid; valid values: {valid}"),
            (z.offload_optimizer == "none" or z.stage >= 1,
             f"zero.offload_optimizer = {z.offload_optimizer!r} needs zero.stage >= 1 (the offloaded optimizer "
             f"updates this rank's shard); got zero.stage = {z.stage}"),
            (z.offload_params == "none" or z.stage == 3,
             f"zero.offload_params = {z.offload_params!r} needs zero.stage = 3 (only stage 3 shards the "
             f"parameters); got zero.stage = {z.stage}"),
            (z.offload_params == "none" or z.offload_optimizer != "none",
             f"zero.offload_params = {z.offload_params!r} needs zero.offload_optimizer = 'cpu' or 'nvme' "
             "(the update runs where the master lives)"),
            (z.nvme_buffer_bytes > 0, f"zero.nvme_buffer_bytes = {z.nvme_buffer_bytes} must be > 0"),
            (not nvme or z.nvme_path != "",
             "zero.offload_optimizer/offload_params = 'nvme' needs zero.nvme_path (a writable directory on "
             "a fast local disk)"),
            (not nvme or not z.nvme_path or (os.path.isdir(z.nvme_path) and os.access(z.nvme_path, os.W_OK | os.X_OK)),
             f"zero.nvme_path = {z.nvme_path!r} is not a writable directory; create it or point zero.nvme_path "
             "at one"),
        )

    def predivide(self, dp_size: int) -> float:
        """The factor gradients are divided by before the data-parallel sum."""
        return float(dp_size) if self.grad_predivide_factor == 0 else self.grad_predivide_factor


@dataclass
class LossScaleConfig:
    """fp16 dynamic loss scaling; the TOML `[precision]` section's loss-scale keys, key for key (pretrain's
    section adds the dtype). The engine's LossScaler (zero3d/precision.py) runs on these values."""

    # The scale of the first step.
    initial_loss_scale: float = 2.0**16
    # The scale never backs off below this.
    min_loss_scale: float = 1.0
    # Clean (non-overflow) steps before the scale grows by growth_factor.
    growth_interval: int = 1000
    # The scale is multiplied by this when it backs off.
    backoff_factor: float = 0.5
    # Overflows tolerated before backing off.
    hysteresis: int = 2
    # The scale is multiplied by this after growth_interval clean steps.
    growth_factor: float = 2.0

    def __post_init__(self):
        _raise_first((
            *_finite("precision", self),
            (self.initial_loss_scale >= self.min_loss_scale > 0,
             f"precision.initial_loss_scale = {self.initial_loss_scale} must be >= precision.min_loss_scale = "
             f"{self.min_loss_scale} > 0"),
            (0 < self.backoff_factor < 1, f"precision.backoff_factor = {self.backoff_factor} must be in (0, 1)"),
            (self.growth_factor > 1, f"precision.growth_factor = {self.growth_factor} must be > 1"),
            (self.growth_interval >= 1, f"precision.growth_interval = {self.growth_interval} must be >= 1"),
            (self.hysteresis >= 1, f"precision.hysteresis = {self.hysteresis} must be >= 1"),
        ))
