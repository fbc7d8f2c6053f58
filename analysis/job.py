"""What the analysis is asked about, as objects: where a model runs (`Parallelism`), what ZeRO does (`ZeroChoice`: a
run's ZeroConfig, or a layout the planner weighs), what one step holds besides the model states (`Step`) and the
device memory it is judged against (`Budget`). The estimator, the planner and the memory check pass these, not their
fields one by one; `job_of` builds them from the fields given flat (the paper searches' and the tables' form)."""
import dataclasses
from dataclasses import dataclass
from typing import Optional

from analysis.modes import mode_name, named_modes
from zero3d.comm.modes import CARDS, CommModes
from zero3d.config import ZeroConfig

GIB = 2**30
# The budget convention, one for the planner, `--plan`, `python -m pretrain --estimate` and the guard:
# a device's memory in GiB, the unit vendors label cards in (cluster.gpu_memory_gb = 32 means 32 GiB).
# A V100-SXM3-32GB carries 32 GiB of HBM2 and torch reports ~31.7 GiB of it, so the paper's
# 32 GB = 32e9 (Tables I and II, analysis.paper_tables) would under-state the card by 2.4e9.
V100_MEMORY_BYTES = 32 * GIB
# CUDA context, NCCL/cuBLAS workspaces and allocator fragmentation (docs/estimator.md, Margin). 10%:
# the paper ran 12B/13B data-parallel only and 170B (C5) on 32 GiB V100s, rows whose estimates leave
# 4.6-5.1 GB of the card, so a larger margin would refuse jobs the paper ran (docs/zero-paper-facts.md
# §4.10, §4.11).
DEFAULT_MARGIN_FRACTION = 0.10
DEFAULT_BUCKET_ELEMENTS = ZeroConfig.bucket_elements  # CB: the engine's zero.bucket_elements default


@dataclass(frozen=True)
class Parallelism:
    """Where the model (one pipeline stage's share of it) runs: gpus = tp × cp × dp GPUs, ZeRO sharding over the
    dp·cp = gpus / tp ranks of data × context, and `dp_per_node` of those ranks on each node (the engine's rank → node
    rule, zero3d.comm.topology.dp_ranks_per_node; read by hpZ and hybrid); `pp` pipeline stages, each holding up to
    pp micro-batches in flight."""

    gpus: int
    tp: int = 1
    cp: int = 1
    dp_per_node: int = 1
    pp: int = 1

    @property
    def dp(self) -> int:
        """ZeRO's group: data × context."""
        return self.gpus // self.tp


@dataclass(frozen=True)
class ZeroChoice:
    """One ZeRO configuration: the DP stage, the ZeRO-R activation options, offload, a node-aware communication mode
    and the buckets; a run's `[zero]` section (`of`) or a layout the planner weighs (PAPER_CONFIGS: C1-C5)."""

    stage: int
    pa: bool = False
    pa_cpu: bool = False
    offload_optimizer: str = "none"  # zero.offload_optimizer: "none", "cpu", "nvme"
    offload_params: str = "none"  # zero.offload_params (stage 3)
    zeropp: str = ""  # a node-aware mode of comm_model.STAGE_MODES[stage] (+hybrid, +qgZ, ...), "" for none
    bucket_elements: Optional[int] = DEFAULT_BUCKET_ELEMENTS  # CB; None: no CB, the paper's 4Ψ fused buffer
    prefetch_units: int = ZeroConfig.prefetch_units  # stage 3: units gathered ahead
    fp8_gather: bool = False  # zero.fp8_gather: stage 3 gathers the FP8 linear weights as float8
    nvme_buffer_bytes: int = ZeroConfig.nvme_buffer_bytes  # the NVMe stream's host buffers

    @classmethod
    def of(cls, zero: ZeroConfig) -> "ZeroChoice":
        """A run's `[zero]` section as the analysis reads it."""
        return cls(stage=zero.stage, pa=zero.partition_activations, pa_cpu=zero.cpu_checkpointing,
                   offload_optimizer=zero.offload_optimizer, offload_params=zero.offload_params,
                   zeropp=mode_name(zero.comm_modes()), bucket_elements=zero.bucket_elements,
                   prefetch_units=zero.prefetch_units, fp8_gather=zero.fp8_gather,
                   nvme_buffer_bytes=zero.nvme_buffer_bytes)

    @property
    def modes(self) -> CommModes:
        return named_modes(self.zeropp)

    @property
    def offloaded(self) -> bool:
        return self.offload_optimizer != "none"

    @property
    def label(self) -> str:
        names = {0: "DP", 1: "P_os", 2: "P_os+g", 3: "P_os+g+p"}
        extra = " + P_a+cpu" if self.pa_cpu else " + P_a" if self.pa else ""
        if self.offloaded:
            extra += f" + opt→{self.offload_optimizer}"
        if self.offload_params != "none":
            extra += f" + params→{self.offload_params}"
        if self.zeropp:
            extra += " + " + self.zeropp.lstrip("+")
        return names[self.stage] + extra


@dataclass(frozen=True)
class Step:
    """What one step of a rank holds besides the model states: `micro_batch` samples at a time, `recompute`
    (estimate.RECOMPUTE), activations and gradients in `precision` (model_states.PRECISIONS), `attention`
    (estimate.ATTENTION_KINDS), the loss `loss_chunk_tokens` tokens at a time (0: all; `loss_recompute`: recomputed in
    backward), `float8` GEMMs (precision.fp8), `accumulation` micro-batches a step, `document_masks`: per-sample
    attention masks of document boundaries (data.reset_attention_mask; estimate.document_mask_bytes),
    `sequence_parallel` (parallel.sequence_parallel: the activations TP leaves whole cut over the TP ranks' tokens)
    and `compiled` layers (model.compile: the kernel path the planner's time reads; the fused loss's softmax, compiled
    too, holds fewer bytes a logit: loss_memory.loss_logit_bytes). `grad_shard_per_step`: the step is this engine's with
    one micro-batch on the rank and no pipeline, so its stage 2/3 gradient shard exists only from the first reduced
    bucket piece of backward on (model_states.late_shard_room, stage3_peak.stage3_moments)."""

    micro_batch: int = 1
    recompute: str = "none"
    precision: str = "fp16"
    attention: str = "local"
    loss_chunk_tokens: int = 0
    loss_recompute: bool = False
    float8: str = "none"
    accumulation: int = 1
    document_masks: bool = False
    sequence_parallel: bool = False
    compiled: bool = False
    grad_shard_per_step: bool = False


@dataclass(frozen=True)
class Budget:
    """The device memory a rank is judged against, and the share of it kept back as the margin."""

    gpu_memory_bytes: float = V100_MEMORY_BYTES
    margin_fraction: float = DEFAULT_MARGIN_FRACTION


# the flat form's names of the node-aware modes memory reads (their cards: zero3d/comm/modes.py)
MODE_FLAGS = tuple(card.field for card in CARDS if card.splits_node)


def job_of(**fields) -> tuple:
    """(Parallelism, ZeroChoice, Step, Budget) from their fields given flat, each object taking the fields it has (the
    stage defaults to ZeroConfig's); `secondary_partition` / `hybrid` = True name the mode (ZeroChoice.zeropp). A name
    no object has is a TypeError naming it."""
    objects = (Parallelism, ZeroChoice, Step, Budget)
    names = {f.name: cls for cls in objects for f in dataclasses.fields(cls)}
    modes = CommModes(**{flag: fields.pop(flag, False) for flag in MODE_FLAGS})
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise TypeError(f"{unknown[0]!r} is not a field of {', '.join(c.__name__ for c in objects)}; valid: "
                        f"{', '.join(sorted(names) + list(MODE_FLAGS))}")
    given = {cls: {k: v for k, v in fields.items() if names[k] is cls} for cls in objects}
    given[ZeroChoice].setdefault("stage", ZeroConfig.stage)
    if modes.node_aware:
        given[ZeroChoice]["zeropp"] = mode_name(modes)
    return tuple(cls(**given[cls]) for cls in objects)
