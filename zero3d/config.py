"""The engine's settings — ZeRO, optimizer, loss scaling — as dataclasses that check themselves when built."""
import dataclasses
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


# Each optimizer's own keys of [optimizer] (zero3d/optim/: the spec of each `optimizer.name` holds its class): a
# dataclass that checks itself when OptimizerConfig builds it from the section's values (`OptimizerConfig.hyper`).
# A key of another optimizer, set, is an error naming the optimizers it belongs to.


@dataclass(frozen=True)
class AdamWKeys:
    """AdamW (Loshchilov & Hutter 2019; torch's AdamW): moments' decays and the denominator's epsilon."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        _raise_first(_betas(self) + ((self.eps > 0, f"optimizer.eps = {self.eps} is invalid; must be > 0"),))


@dataclass(frozen=True)
class LionKeys:
    """Lion (Chen et al. 2023): beta1 interpolates the update's sign, beta2 decays the momentum."""

    beta1: float = 0.9
    beta2: float = 0.99

    def __post_init__(self):
        _raise_first(_betas(self))


@dataclass(frozen=True)
class SGDKeys:
    """SGD with momentum, torch's rule (momentum buffer μ·b + g, weight decay added to the gradient)."""

    momentum: float = 0.9
    nesterov: bool = False

    def __post_init__(self):
        _raise_first(((0 <= self.momentum < 1, f"optimizer.momentum = {self.momentum} is invalid; must be in [0, 1)"),))


@dataclass(frozen=True)
class MuonKeys:
    """Muon (K. Jordan 2024; Moonshot's scale) on the hidden matrices, AdamW (beta1, beta2, eps) on the rest."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        _raise_first(((0 <= self.momentum < 1, f"optimizer.momentum = {self.momentum} is invalid; must be in [0, 1)"),
                      (type(self.ns_steps) is int and self.ns_steps >= 1,
                       f"optimizer.ns_steps = {self.ns_steps!r} is invalid; must be an integer >= 1"),
                      *_betas(self),
                      (self.eps > 0, f"optimizer.eps = {self.eps} is invalid; must be > 0")))


def _betas(keys) -> tuple:
    return tuple((0 <= getattr(keys, k) < 1, f"optimizer.{k} = {getattr(keys, k)} is invalid; must be in [0, 1)")
                 for k in ("beta1", "beta2"))


OPTIMIZER_KEYS = {"adamw": AdamWKeys, "lion": LionKeys, "sgd": SGDKeys, "muon": MuonKeys}
OPTIMIZER_NAMES = tuple(OPTIMIZER_KEYS)


def key_owners(key: str) -> list:
    """The optimizers whose own keys include `key`."""
    return [name for name, keys in OPTIMIZER_KEYS.items() if key in {f.name for f in dataclasses.fields(keys)}]


@dataclass
class OptimizerConfig:
    """The engine's optimizer and its settings; the TOML `[optimizer]` section's engine keys, key for key (pretrain's
    section adds the learning-rate schedule). Validated in `__post_init__`: the common keys here, the named
    optimizer's own keys by its class (OPTIMIZER_KEYS), and no key of another optimizer set."""

    # Which optimizer: "adamw"; "lion" (sign of an interpolated momentum); "sgd" (with momentum); "muon"
    # (Newton–Schulz-orthogonalized momentum on the hidden 2-D matrices, each taken whole across ZeRO and TP;
    # AdamW on embeddings, output layer, norms and biases). Its own keys are below; another's, set, is an error.
    name: Literal["adamw", "lion", "sgd", "muon"] = "adamw"
    # Dtype of the optimizer's per-element states (Adam's moments, momentum buffers), on the device and offloaded:
    # "bf16" halves them (K = 4 + 8 → 4 + 4 bytes a parameter for AdamW); the master stays fp32 and the update is
    # computed in fp32 (states upcast, updated, rounded back to nearest). With beta2 near 1 (1 − beta2 < 2⁻⁸) most of
    # the second moment's increments round away in bf16 (docs/optimizers.md).
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    # Peak learning rate (the loop passes each step's value to `engine.step(lr)`).
    lr: float = 1e-3
    # Decoupled weight decay, applied to the "decay" groups only (matrices; not biases or norms).
    weight_decay: float = 0.0
    # adamw, muon's AdamW part: the first moment's decay; lion: the interpolation whose sign is the update.
    beta1: float = 0.9
    # adamw, muon's AdamW part: the second moment's decay; lion: its momentum's decay (Lion's paper: 0.99).
    beta2: float = 0.999
    # adamw, muon's AdamW part: added to the denominator for numerical stability.
    eps: float = 1e-8
    # sgd, muon: the momentum buffer's decay μ (b ← μ·b + g); unset: sgd 0.9, muon 0.95.
    momentum: Optional[float] = None
    # sgd, muon: Nesterov momentum (the update g + μ·b instead of b); unset: sgd false, muon true.
    nesterov: Optional[bool] = None
    # muon: Newton–Schulz iterations per step; unset: 5.
    ns_steps: Optional[int] = None
    # Gradients are scaled so their global norm is at most this; 0 disables clipping.
    clip_grad: float = 0.0
    # Parameters that never decay beside biases and norms (which never do): comma-separated fnmatch patterns of
    # their names, e.g. "embedding.*" (word and position embeddings) or "*.linear_fc1.weight"; "" for none.
    no_weight_decay: str = ""

    def __post_init__(self):
        _raise_first((
            *_finite("optimizer", self),
            (self.name in OPTIMIZER_KEYS, f"optimizer.name = {self.name!r} is invalid; valid values: "
             + ", ".join(map(repr, OPTIMIZER_NAMES))),
            (self.state_dtype in ("fp32", "bf16"),
             f"optimizer.state_dtype = {self.state_dtype!r} is invalid; valid values: 'fp32', 'bf16'"),
            (self.lr > 0, f"optimizer.lr = {self.lr} must be > 0"),
            (self.clip_grad >= 0, f"optimizer.clip_grad = {self.clip_grad} must be >= 0 (0 disables)"),
            (self.weight_decay >= 0, f"optimizer.weight_decay = {self.weight_decay} is invalid; must be >= 0"),
            (all(p.strip() for p in self.no_weight_decay.split(",")) or not self.no_weight_decay,
             f"optimizer.no_weight_decay = {self.no_weight_decay!r} has an empty pattern; give comma-separated "
             "fnmatch patterns of parameter names, e.g. \"embedding.*,output_layer.weight\""),
            *((False, self.foreign_key_error(key)) for key in self.foreign_keys(self.changed_keys())),
        ))
        self.hyper  # noqa: B018 - the named optimizer's keys check themselves

    def changed_keys(self) -> list:
        """The optimizers' own keys whose value is not this class's default (set, for all the engine can tell)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [key for key in _OWNED_KEYS if getattr(self, key) != defaults[key]]

    def foreign_keys(self, given) -> list:
        """Those of `given` that belong only to other optimizers than `name`."""
        return [key for key in given if key in _OWNED_KEYS and self.name not in key_owners(key)]

    def foreign_key_error(self, key: str) -> str:
        return (f"optimizer.{key} is set but optimizer.name = {self.name!r} does not use it (it belongs to "
                f"{', '.join(key_owners(key))}); remove it or set optimizer.name to one of them")

    @property
    def hyper(self):
        """The named optimizer's own keys, built (and so checked) from this section's values (unset: its defaults)."""
        keys = OPTIMIZER_KEYS[self.name]
        return keys(**{f.name: getattr(self, f.name) for f in dataclasses.fields(keys) if getattr(self, f.name) is not None})

    @property
    def no_decay_patterns(self) -> tuple:
        return tuple(p.strip() for p in self.no_weight_decay.split(",") if p.strip())

    @property
    def betas(self) -> tuple:
        return (self.beta1, self.beta2)


_OWNED_KEYS = tuple(dict.fromkeys(f.name for keys in OPTIMIZER_KEYS.values() for f in dataclasses.fields(keys)))


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
