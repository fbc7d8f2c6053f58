"""ZeRO-Offload / ZeRO-Infinity in the estimator: device, host and NVMe bytes and PCIe traffic per step."""
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Iterator, Optional

from analysis.estimate import (ADAMW_FP32, DEFAULT_BUCKET_ELEMENTS, DEFAULT_MARGIN_FRACTION, GB, MASTER_BYTES,
                               PRECISIONS, V100_MEMORY_BYTES, MemoryBreakdown, OptimizerStates, Parallelism,
                               ZeroChoice, estimate_from_shape, gpt_param_count, largest_fitting_layers)
from analysis.step_moment import step_moment_bytes
from zero3d.config import PLACEMENTS as OFFLOAD_PLACEMENTS
from zero3d.config import ZeroConfig

DEFAULT_NVME_BUFFER_BYTES = ZeroConfig.nvme_buffer_bytes  # the NVMe stream's two host buffers, as the engine defaults them
# --largest without --hidden/--heads: the Figure 7 hidden sizes and GPT-3 13B's 5120 × 40, then
# hidden grown by HIDDEN_STEP at GPT-3's head size (heads = hidden / HEAD_DIM) until not one layer fits
OFFLOAD_SHAPES = ((1536, 16), (1920, 16), (2304, 24), (3072, 24), (4096, 32), (5120, 40))
HIDDEN_STEP = 1024
HEAD_DIM = 128


def growing_shapes() -> Iterator[tuple]:
    """OFFLOAD_SHAPES, then (5120 + k·HIDDEN_STEP, hidden / HEAD_DIM) for k = 1, 2, ... without end."""
    last = OFFLOAD_SHAPES[-1][0]
    grown = ((h, h // HEAD_DIM) for h in itertools.count(last + HIDDEN_STEP, HIDDEN_STEP))
    return itertools.chain(OFFLOAD_SHAPES, grown)


@dataclass(frozen=True)
class OffloadBreakdown:
    """Per-GPU bytes with offloaded states moved out of `device`, by where they went.

    `host` and `nvme` are keyed by the engine's state categories (docs/metrics.md `mem/host_*`,
    `mem/nvme_*`; `host["checkpoints"]` are Pa+cpu checkpoints); traffic is per optimizer step.
    """

    device: MemoryBreakdown  # the estimator's categories, the offloaded ones at 0
    offload_optimizer: str
    offload_params: str
    grads_on_host: bool
    host: dict = field(default_factory=dict)
    nvme: dict = field(default_factory=dict)
    pcie_bytes_per_step: float = 0.0  # device <-> host, both directions
    nvme_bytes_per_step: float = 0.0  # file reads + writes

    @property
    def host_bytes(self) -> float:
        return sum(self.host.values())

    @property
    def nvme_bytes(self) -> float:
        return sum(self.nvme.values())

    @property
    def fits(self) -> bool:
        """Does what stays on the device fit it? (Host and NVMe capacity: planner.Cluster.)"""
        return self.device.fits

    @property
    def label(self) -> str:
        parts = [f"optimizer→{self.offload_optimizer}"]
        if self.offload_params != "none":
            parts.append(f"params→{self.offload_params}")
        if self.grads_on_host:
            parts.append("grads→host")
        return "offload " + ", ".join(parts)


def validate_offload(stage: int, offload_optimizer: str, offload_params: str = "none",
                     nvme_buffer_bytes: float = DEFAULT_NVME_BUFFER_BYTES, accumulation: int = 1) -> None:
    """Raise ValueError naming the bad offload setting and what would be valid."""
    for key, value in (("offload_optimizer", offload_optimizer), ("offload_params", offload_params)):
        if value not in OFFLOAD_PLACEMENTS:
            raise ValueError(f"{key} = {value!r} is invalid; valid: {', '.join(map(repr, OFFLOAD_PLACEMENTS))}")
    if offload_optimizer != "none" and stage == 0:
        raise ValueError(f"offload_optimizer = {offload_optimizer!r} needs stage >= 1 (got stage = {stage}): "
                         "the offloaded optimizer updates this rank's shard")
    if offload_params != "none" and (stage != 3 or offload_optimizer == "none"):
        raise ValueError(f"offload_params = {offload_params!r} needs stage = 3 and offload_optimizer = 'cpu' "
                         f"or 'nvme' (got stage = {stage}, offload_optimizer = {offload_optimizer!r})")
    if nvme_buffer_bytes <= 0:
        raise ValueError(f"nvme_buffer_bytes = {nvme_buffer_bytes} is invalid; must be > 0")
    if not isinstance(accumulation, int) or accumulation <= 0:
        raise ValueError(f"accumulation = {accumulation!r} is invalid; must be a positive integer")


def offload_breakdown(m: MemoryBreakdown, layout: Parallelism, zero: ZeroChoice, precision: str = "fp16",
                      accumulation: int = 1, optimizer: OptimizerStates = ADAMW_FP32) -> OffloadBreakdown:
    """Move what zero3d's `zero.offload_optimizer` / `zero.offload_params` move (`zero`: a ZeroChoice at its stage,
    with the NVMe stream's `nvme_buffer_bytes`) off the device of a rank of `layout`, `accumulation` micro-batches a
    step in `precision` (docs/estimator.md, Offload).

    Optimizer offload: the K·Ψ/N_d optimizer bytes (fp32 master + the `optimizer`'s states; in fp32 training the
    parameters are the master, and the host keeps its own fp32 master copy besides the states) leave
    the device. "cpu" holds them in host memory with an fp32 gradient shard (plus a compute-dtype
    staging copy the pieces land in); at stages 2-3 that host shard is the only one, as in ZeRO-Offload
    (Ren et al. 2021): the device keeps just the bucket buffers. "nvme" holds them in files and only
    `nvme_buffer_bytes` of host buffers, and its gradient shard stays on the device (host memory stays
    bounded); its step casts it to fp32 a chunk at a time, so neither keeps an fp32 gradient on the device for the
    step (`MemoryBreakdown.step_bytes`: NVMe's chunks, at stage 1 its pieces of the whole gradient joined).
    Parameter offload (stage 3) moves the compute-dtype parameter shard, 2Ψ/N_d, too.
    PCIe per step: at stages 2-3 each micro-batch's reduced gradient shard goes down as it lands
    (stage 1: the fp32 shard once, at the step), the updated compute-dtype shard comes up once; with
    parameter offload there is no upload, but every forward and backward gather fetches the shard.
    """
    stage, gpus, tp = zero.stage, layout.gpus, layout.tp
    offload_optimizer, offload_params, nvme_buffer_bytes = zero.offload_optimizer, zero.offload_params, zero.nvme_buffer_bytes
    validate_offload(stage, offload_optimizer, offload_params, nvme_buffer_bytes, accumulation)
    grads_on_host = offload_optimizer == "cpu" and stage >= 2  # what zero3d's HostOffload does
    p = PRECISIONS[precision]
    shard = m.params_per_rank / (gpus // tp)  # Ψ/N_d: this rank's share of every sharded state
    device = {}
    host = {"checkpoints": m.host_bytes} if m.host_bytes else {}
    nvme = {}
    pcie = nvme_io = 0.0
    if offload_optimizer != "none":
        device["optimizer_bytes"] = 0.0
        mixed = p.master_bytes > 0  # K includes the master; in fp32 K is the optimizer states alone
        moments = float(optimizer.k(precision) - p.master_bytes) * shard
        states = {"master_params": MASTER_BYTES * shard, "optimizer_states": moments}
        staging = p.grad_bytes * shard if mixed or grads_on_host else 0.0
        grads = {"grads": 4 * shard + staging}  # fp32 shard the optimizer reads (+ the copy that lands)
        if offload_optimizer == "cpu":
            host.update(states, **grads)
        else:
            nvme.update(states)
            host["buffers"] = float(nvme_buffer_bytes)
            nvme_io += 2 * sum(states.values())  # every state read and written back once per step
        pcie += p.grad_bytes * shard * accumulation if stage >= 2 else 4 * shard
        if offload_params == "none":
            pcie += p.param_bytes * shard  # the updated shard back to the device
        if grads_on_host:
            device["grad_bytes"] = 0.0
        device["step_bytes"] = step_moment_bytes(offload_optimizer, shard, mixed, 0, m.step_join_bytes,
                                                 m.matrix_step_bytes)
    if offload_params != "none":
        moved = p.param_bytes * shard
        device["param_bytes"] = 0.0
        gathers = 2 * accumulation  # forward and backward of every micro-batch
        pcie += gathers * moved
        if offload_params == "cpu":
            host["params"] = moved
        else:
            nvme["params"] = moved
            nvme_io += (gathers + 1) * moved  # read per gather, written once by the update
    return OffloadBreakdown(dataclasses.replace(m, **device), offload_optimizer, offload_params, grads_on_host,
                            host, nvme, pcie, nvme_io)


@dataclass(frozen=True)
class LargestOffload:
    """The largest GPT whose device memory fits with the given offload; layers 0 when none does."""

    layers: int
    hidden: int
    heads: int
    params: int  # whole model (tp = 1 count), embeddings included
    offload: Optional[OffloadBreakdown]


def largest_offload_gpt(*, hidden_heads: Optional[tuple] = None, gpus: int = 1, tp: int = 1, stage: int = 2,
                        micro_batch: int = 1, vocab: int = 50257, seq: int = 1024, recompute: str = "full",
                        bucket_elements: Optional[int] = DEFAULT_BUCKET_ELEMENTS, precision: str = "fp16",
                        offload_optimizer: str = "cpu", offload_params: str = "none",
                        nvme_buffer_bytes: float = DEFAULT_NVME_BUFFER_BYTES,
                        gpu_memory_bytes: float = V100_MEMORY_BYTES,
                        margin_fraction: float = DEFAULT_MARGIN_FRACTION, rule=None) -> LargestOffload:
    """Bisect the layer count at each (hidden, heads); the shape with the most parameters wins.

    `hidden_heads` None: growing_shapes(), skipping those tp does not divide, up to the first shape where
    not one layer fits (memory at one layer grows with hidden, so no larger shape fits either). `rule` (a
    shapes.ShapeRule, with hidden_heads None): its shapes instead, the layers capped at its most and none
    below its fewest, up to the first shape where its fewest layers do not fit.
    """
    if not isinstance(tp, int) or tp <= 0 or gpus % tp:
        raise ValueError(f"gpus = {gpus} is not divisible by tp = {tp}; tp must be a positive divisor of gpus")

    def at(layers: int, hidden: int, heads: int) -> OffloadBreakdown:
        m = estimate_from_shape(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, gpus=gpus, tp=tp,
                                stage=stage, micro_batch=micro_batch, recompute=recompute,
                                bucket_elements=bucket_elements, precision=precision,
                                gpu_memory_bytes=gpu_memory_bytes, margin_fraction=margin_fraction)
        return offload_breakdown(m, Parallelism(gpus, tp), ZeroChoice(stage, offload_optimizer=offload_optimizer,
                                                                      offload_params=offload_params,
                                                                      nvme_buffer_bytes=nvme_buffer_bytes), precision)

    best = LargestOffload(0, 0, 0, 0, None)
    grow = hidden_heads is None
    shapes = hidden_heads if not grow else rule.shapes() if rule else growing_shapes()
    for hidden, heads in shapes:
        if grow and (heads % tp or hidden % tp):
            continue
        layers = largest_fitting_layers(lambda n: at(n, hidden, heads).fits)
        if rule is not None:
            fewest, most = rule.layer_bounds(hidden)
            layers = min(layers, most) if layers >= fewest else 0
        if grow and not layers:
            break
        params = gpt_param_count(layers, hidden, vocab, seq) if layers else 0
        if params > best.params:
            best = LargestOffload(layers, hidden, heads, params, at(layers, hidden, heads))
    return best


def format_offload(o: OffloadBreakdown) -> str:
    """Where the offloaded states went (GB per GPU) and the traffic they cost per step."""
    where = [f"host {k.replace('_', ' ')}" for k in o.host] + [f"NVMe {k.replace('_', ' ')}" for k in o.nvme]
    values = list(o.host.values()) + list(o.nvme.values())
    lines = [f"{o.label}: host {o.host_bytes / GB:.3f} GB, NVMe {o.nvme_bytes / GB:.3f} GB per GPU"]
    lines += [f"  {name:<32}{value / GB:10.3f}" for name, value in zip(where, values)]
    lines.append(f"per step: PCIe {o.pcie_bytes_per_step / GB:.3f} GB, NVMe I/O {o.nvme_bytes_per_step / GB:.3f} GB")
    return "\n".join(lines)
