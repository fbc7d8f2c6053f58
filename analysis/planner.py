"""Planner: feasible (tp, cp, ZeRO stage, Pa, Pa+cpu, offload, micro-batch) layouts ranked by modelled throughput."""
import dataclasses
from dataclasses import dataclass
from typing import Optional

from analysis.cluster import PAPER_CLUSTER, Cluster
from analysis.comm_model import (MUON_VALUE_BYTES, STAGE_MODES, Links, collectives_per_pass, context_bytes_per_step,
                                 dp_collectives, link_seconds, muon_elements_per_step, newton_schulz_flops)
from analysis.context import valid_context_sizes
from analysis.estimate import (DEFAULT_BUCKET_ELEMENTS, DEFAULT_MARGIN_FRACTION, PRECISIONS, RECOMPUTE,
                               V100_MEMORY_BYTES, Budget, MemoryBreakdown, OptimizerStates, Parallelism, Step,
                               ZeroChoice, estimate, estimate_from_shape, gpt_param_count,
                               largest_fitting_layers, paper_shape)
from analysis.modes import named_modes
from analysis.offload_estimate import OffloadBreakdown, offload_breakdown
from analysis.throughput import KernelPath, ideal_seconds
from model_shape.flops import StepFlops
from model_shape.gpt import GPTShape
from optim import spec_named
from zero3d.comm.topology import TopologyError, dp_ranks_per_node

GPT2_VOCAB = 50257
PAPER_SEQ = 1024  # the only sequence length the paper uses


# Escalation when nothing fits on the device alone (zero.offload_optimizer, zero.offload_params): the
# optimizer to the host, then to files (host memory short), then stage 3's parameters as well.
OFFLOAD_TIERS = (("cpu", "none"), ("nvme", "none"), ("cpu", "cpu"), ("nvme", "cpu"), ("nvme", "nvme"))

# Node-aware modes the planner weighs per stage besides plain (comm_model.STAGE_MODES: hybrid at 1-3, qgZ at
# 2-3, hpZ / qwZ at 3); those that need >= 2 DP ranks per node (CommModes.needs_two_per_node) only where a node has them
PLANNER_MODES = {stage: modes[1:] for stage, modes in STAGE_MODES.items()}


def node_split(cluster: Cluster, gpus: int, tp: int) -> Optional[int]:
    """DP ranks (stride tp) that share a node, by the engine's rank → node rule (zero3d.comm.topology.dp_ranks_per_node:
    tp-wide TP groups fill the node, the DP group strides across); None where the DP groups do not split evenly into
    nodes (the engine refuses every node-aware mode there)."""
    try:
        return dp_ranks_per_node(gpus, tp, 1, cluster.gpus_per_node)
    except TopologyError:
        return None


def dp_per_node(cluster: Cluster, gpus: int, tp: int) -> int:
    """The DP ranks a node holds (node_split), 1 where the DP groups do not split evenly into nodes."""
    return node_split(cluster, gpus, tp) or 1


def layout_on(cluster: Cluster, gpus: int, tp: int = 1, cp: int = 1) -> Parallelism:
    """`gpus` GPUs of `cluster` at TP `tp` × CP `cp`, with the DP ranks each of its nodes holds (dp_per_node)."""
    return Parallelism(gpus, tp, cp, dp_per_node(cluster, gpus, tp))


def cluster_links(cluster: Cluster) -> Links:
    """comm_model's link settings for a planner Cluster (Cluster.links)."""
    return cluster.links


# Table III: every configuration also runs C_B and M_D
PAPER_CONFIGS = {"C1": ZeroChoice(1), "C2": ZeroChoice(1, pa=True), "C3": ZeroChoice(2),
                 "C4": ZeroChoice(2, pa=True), "C5": ZeroChoice(2, pa=True, pa_cpu=True)}


@dataclass(frozen=True)
class Candidate:
    """One feasible layout with its memory and the parts of its modelled step time (seconds)."""

    tp: int
    dp: int
    zero: ZeroChoice
    micro_batch: int
    global_batch: int
    accumulation: int
    memory: MemoryBreakdown
    compute_s: float
    mp_s: float  # tensor-parallel all-reduces, on the critical path
    pa_s: float  # Pa all-gathers
    offload_s: float  # Pa+cpu host traffic
    dp_s: float  # exposed (not overlapped) data-parallel communication
    pcie_s: float  # ZeRO-Offload's gradient / parameter traffic over PCIe, not overlapped
    tflops_per_gpu: float
    samples_per_s: float
    offload: Optional[OffloadBreakdown] = None  # host / NVMe bytes and traffic when zero.offloaded
    cp: int = 1  # context-parallel ranks splitting each sequence (dp × cp = the ZeRO group)
    cp_s: float = 0.0  # the K/V all-gathers and reduce-scatters over the CP group, on the critical path
    optimizer_s: float = 0.0  # Muon's whole-matrix step: its exchange and its owners' Newton–Schulz, not overlapped
    step: Optional[Step] = None  # what a step of this layout holds (its micro-batch, recompute policy, SP, ...)

    @property
    def step_s(self) -> float:
        return (self.compute_s + self.mp_s + self.pa_s + self.offload_s + self.dp_s + self.pcie_s + self.cp_s
                + self.optimizer_s)


def compute_seconds(cluster: Cluster, flops: StepFlops, step: Step, gpus: int) -> float:
    """The step's hardware FLOPs over `gpus` GPUs at the cluster's peaks (throughput.ideal_seconds: float8 GEMMs at its
    float8 peak) times the share of peak measured along the step's kernel path (Cluster.efficiency_along)."""
    if step.float8 != "none" and cluster.fp8_peak_flops is None:
        raise ValueError(f"float8 = {step.float8!r} needs float8 tensor cores; {cluster.name} has none (e.g. "
                         "--cluster dgx-h100 or dgx-h200)")
    ideal = ideal_seconds(flops, step.recompute, step.float8, cluster.peak_flops, cluster.fp8_peak_flops)
    return ideal / (gpus * cluster.efficiency_along(KernelPath.of(step)).value)


def step_time(cluster: Cluster, model: GPTShape, layout: Parallelism, zero: ZeroChoice, step: Step, global_batch: int,
              params_per_rank: int, pcie_bytes: float = 0.0, optimizer: str = "adamw") -> dict:
    """Modelled step-time parts of `model` on `layout` under `zero`, each step holding `step` (its micro-batch,
    recompute, precision, attention, float8); overlap assumptions in docs/estimator.md §Planner. The compute is the
    model's hardware FLOPs (GPTShape.step_flops: its MLP, query groups and padded vocabulary; recompute included), the
    float8 GEMMs at the float8 peak with `step.float8` (compute_seconds). `layout.cp` context-parallel ranks: each runs
    S/cp tokens a sequence, ZeRO's collectives span dp·cp = gpus/tp, `layout.dp_per_node` of them on a node.
    `optimizer` (optimizer.name): Muon adds its whole-matrix step (muon_seconds). `zero.fp8_gather` (stage 3): the
    layers' linear weights gathered as float8 codes (comm_model.dp_collectives); `zero.bucket_elements`: the
    collectives per pass (collectives_per_pass)."""
    gpus, tp, cp = layout.gpus, layout.tp, layout.cp
    micro_batch, recompute, precision, attention, float8 = (step.micro_batch, step.recompute, step.precision,
                                                            step.attention, step.float8)
    layers, hidden, seq = model.layers, model.hidden, model.seq // cp
    dp = gpus // (tp * cp)
    if global_batch % (micro_batch * dp):
        raise ValueError(f"global_batch = {global_batch} is not a multiple of micro_batch × dp = "
                         f"{micro_batch} × {dp}")
    accumulation = global_batch // (micro_batch * dp)
    act_bytes = PRECISIONS[precision].activation_bytes
    step_flops = model.step_flops(global_batch, recompute == "full", tp, loss_recompute=step.loss_recompute,
                                  recomputed_attention=recompute == "selective" and attention == "local")
    flops = step_flops.hardware
    compute = compute_seconds(cluster, step_flops, step, gpus)
    micro_compute = compute / accumulation
    # MP link: NVSwitch while the TP group stays inside a node, else the node's share of IB
    inside_node = tp <= cluster.gpus_per_node
    mp_bw = cluster.intra_node_bandwidth if inside_node else cluster.inter_node_bandwidth_per_gpu
    per_layer = micro_batch * seq * hidden * act_bytes  # one b·s·h message, in bytes
    allreduces = 12 if recompute == "full" else 8  # volume 2× message: 6 all-reduces, or 4 unrecomputed
    mp = accumulation * allreduces * per_layer * layers / mp_bw if tp > 1 else 0.0
    pa = accumulation * per_layer * layers / mp_bw if zero.pa and tp > 1 else 0.0
    offload = accumulation * 2 * per_layer * layers / cluster.pcie_bandwidth if zero.pa_cpu else 0.0
    # DP: the stage's per-link collectives (comm_model.dp_collectives), one α per ring step of every
    # bucket's / unit's collective (collectives_per_pass), under today's overlap rules per stage
    buckets, gathers = collectives_per_pass(params_per_rank, zero.bucket_elements, layers + 2)
    links = cluster_links(cluster)
    float8_gather = dict(float8_elements=layers * model.layer_linear_weights(tp), float8_weights=4 * layers,
                         float8_groups=layers) if zero.fp8_gather and zero.stage == 3 else {}
    colls = dp_collectives(zero.stage, zero.zeropp, params_per_rank, dp * cp, layout.dp_per_node,
                           value_bytes=PRECISIONS[precision].grad_bytes, accumulation=accumulation,
                           buckets=buckets, gathers=gathers, **float8_gather)
    seconds = {purpose: sum(link_seconds(c, links) for c in colls if c.purpose == purpose)
               for purpose in ("grads", "params", "replicas")}
    backward = micro_compute * (3 / 4 if recompute == "full" else 2 / 3)
    if zero.stage == 3:
        # prefetched under each micro-batch's compute up to its length
        dp_exposed = max(0.0, sum(seconds.values()) - accumulation * micro_compute)
    elif zero.stage == 0:
        # bucketed all-reduce of the accumulated gradients overlaps the last backward
        dp_exposed = max(0.0, seconds["grads"] - backward)
    elif zero.stage == 1:
        # the accumulated gradients' reduce-scatter overlaps the last backward; the parameter all-gather
        # (and hybrid's cross-node all-reduce of the shard, once per step) does not
        dp_exposed = max(0.0, seconds["grads"] - backward) + seconds["params"] + seconds["replicas"]
    else:
        # a reduce-scatter per micro-batch, each under its own backward; the all-gather and hybrid's
        # cross-node all-reduce are not
        dp_exposed = (accumulation * max(0.0, seconds["grads"] / accumulation - backward) + seconds["params"]
                      + seconds["replicas"])
    pcie = pcie_bytes / cluster.pcie_bandwidth  # ZeRO-Offload; the CPU optimizer's own time is not modelled
    cp_s = context_seconds(cluster, model, tp, cp, micro_batch, accumulation, act_bytes, recompute)
    optimizer_s = muon_seconds(cluster, model, gpus, tp, cp, zero.stage) if spec_named(optimizer).matrix else 0.0
    step_s = compute + mp + pa + offload + dp_exposed + pcie + cp_s + optimizer_s
    return dict(dp=dp, global_batch=global_batch, accumulation=accumulation, compute_s=compute, mp_s=mp,
                pa_s=pa, offload_s=offload, dp_s=dp_exposed, pcie_s=pcie, tflops_per_gpu=flops / step_s / gpus / 1e12,
                samples_per_s=global_batch / step_s, cp_s=cp_s, optimizer_s=optimizer_s)


def muon_seconds(cluster: Cluster, model: GPTShape, gpus: int, tp: int, cp: int, stage: int) -> float:
    """Muon's whole-matrix step (comm_model.muon_elements_per_step, fp32): the all-to-all over the ZeRO group (its
    bytes at the DP link's bandwidth, one α per peer) and the TP all-gather (a ring inside the node while TP fits one),
    then the owners' Newton–Schulz on the whole matrices (comm_model.newton_schulz_flops, the rank's share: 1/N of the
    layers' at stages 1-3, all of them at stage 0) at the sustained share of the GPU's plain fp32 rate (the engine
    runs it in fp32); none of it overlaps compute."""
    zero_group = gpus // tp
    a2a, tp_gather = muon_elements_per_step(model.hidden_matrix_params(tp), zero_group, tp, stage)
    links = cluster_links(cluster)
    spans = zero_group * tp > cluster.gpus_per_node
    dp_bw = cluster.inter_node_bandwidth_per_gpu if spans else cluster.intra_node_bandwidth
    alpha = links.ib_latency if spans else links.nvswitch_latency
    exchange = (float(a2a) * MUON_VALUE_BYTES / dp_bw + (zero_group - 1) * alpha if a2a else 0.0)
    tp_bw = cluster.intra_node_bandwidth if tp <= cluster.gpus_per_node else cluster.inter_node_bandwidth_per_gpu
    join = float(tp_gather) * MUON_VALUE_BYTES / tp_bw + (tp - 1) * links.nvswitch_latency if tp > 1 else 0.0
    h, f, kv = model.hidden, model.ffn_size, model.kv_width
    shapes = [(h + 2 * kv, h), (h, h), (f * (2 if model.gated else 1), h), (h, f)]
    flops = model.layers * sum(newton_schulz_flops(r, c) for r, c in shapes) / (zero_group if stage else 1)
    return exchange + join + flops / ((cluster.fp32_flops or cluster.peak_flops) * cluster.efficiency)


def context_seconds(cluster: Cluster, model: GPTShape, tp: int, cp: int, micro_batch: int, accumulation: int,
                    act_bytes: int, recompute: str) -> float:
    """The K/V all-gathers and reduce-scatters over the CP group in a step (comm_model.context_bytes_per_step), cp − 1
    ring steps each, inside the node while the tp·cp ranks fit one, not overlapped (attention waits on its gather)."""
    if cp == 1:
        return 0.0
    inside = tp * cp <= cluster.gpus_per_node
    sent = context_bytes_per_step(seq=model.seq, kv_width=model.kv_width, layers=model.layers, micro_batch=micro_batch,
                                  accumulation=accumulation, tp=tp, cp=cp, act_bytes=act_bytes, recompute=recompute)
    calls = model.layers * accumulation * (3 if recompute == "full" else 2)
    links = cluster_links(cluster)
    return (float(sent) / (cluster.intra_node_bandwidth if inside else cluster.inter_node_bandwidth_per_gpu)
            + calls * (cp - 1) * (links.nvswitch_latency if inside else links.ib_latency))


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan(cluster: Cluster = PAPER_CLUSTER, *, layers: Optional[int] = None, hidden: Optional[int] = None,
         heads: Optional[int] = None, vocab: int = GPT2_VOCAB, seq: int = PAPER_SEQ, model: Optional[GPTShape] = None,
         global_batch: Optional[int] = None, batch_per_gpu: Optional[int] = None,
         gpus: Optional[int] = None, recompute: str = "full",
         bucket_elements: Optional[int] = DEFAULT_BUCKET_ELEMENTS, precision: str = "fp16",
         margin_fraction: float = DEFAULT_MARGIN_FRACTION,
         tp_choices: Optional[list] = None, stages=(0, 1, 2, 3), offload: bool = True,
         attention: str = "local", optimizer: str = "adamw", state_dtype: str = "fp32",
         float8: str = "none", fp8_gather: bool = False, step: Optional[Step] = None,
         zero: Optional[ZeroChoice] = None) -> list:
    """Every layout that fits, best modelled throughput first.

    The model: `model` (any GPTShape), or the paper's GPT-2 shape by `layers`, `hidden`, `heads`, `vocab`, `seq`.
    Give `global_batch` (fixed samples per step) or `batch_per_gpu` (samples per DP rank, the paper's
    per-GPU batch: the global batch then grows with the DP degree). Only when no layout fits on the
    device alone (and `offload`), the first of OFFLOAD_TIERS under which some layout fits the device and
    the cluster's host memory and NVMe gives the layouts instead, each with its `offload` breakdown.
    `attention` (estimate.ATTENTION_KINDS): with "fused", a TP degree at which nothing fits also tries context
    parallelism, the smallest cp (a divisor of gpus/tp splitting the sequence into 2·cp chunks) that fits.
    `optimizer`, `state_dtype` (optimizer.name, optimizer.state_dtype): K in the memory (OptimizerStates), and
    Muon's whole-matrix step in the time (muon_seconds).
    `float8` (precision.fp8) and `fp8_gather` (zero.fp8_gather, at stage 3 without hpZ / qwZ): the float8 GEMMs'
    copies and compute, and stage 3's float8 weight gathers (estimate, step_time).
    `recompute`: one of estimate.RECOMPUTE, or several (a tuple) for the planner to choose per layout (selective
    not with cp > 1). `step` (a run's Step, pretrain/memory_check.py's rank_job): what every layout's step
    holds, its precision, attention, float8, loss chunking, per-sample document masks (each layout's counted, and no
    context parallelism with them) and sequence parallelism (at tp > 1) in place of `precision`, `attention` and
    `float8`; its micro-batch, accumulation and recompute are the planner's.
    `zero` (a run's ZeroChoice): the buckets, prefetch, float8 gathers and NVMe buffers every layout takes, in place
    of `bucket_elements` and `fp8_gather`; its stage and modes are the planner's.
    """
    if (global_batch is None) == (batch_per_gpu is None):
        raise ValueError("give exactly one of global_batch (--global-batch) and batch_per_gpu "
                         "(--batch-per-gpu)")
    batch = global_batch if batch_per_gpu is None else batch_per_gpu
    if batch <= 0:
        raise ValueError(f"batch = {batch} is invalid; must be a positive integer")
    if (model is None) == (None in (layers, hidden, heads)):
        raise ValueError("give the model as `model` (a GPTShape) or as layers, hidden and heads, not both")
    model = model or paper_shape(hidden, layers, heads, vocab, seq)
    gpus = gpus or cluster.gpus
    step = step or Step(precision=precision, attention=attention, float8=float8)
    precision, attention, float8 = step.precision, step.attention, step.float8
    zero_template = zero or ZeroChoice(0, bucket_elements=bucket_elements, fp8_gather=fp8_gather)
    bucket_elements, fp8_gather = zero_template.bucket_elements, zero_template.fp8_gather
    recomputes = (recompute,) if isinstance(recompute, str) else tuple(recompute)
    bad = [r for r in recomputes if r not in RECOMPUTE]
    if bad or not recomputes:
        raise ValueError(f"recompute = {bad[0] if bad else recompute!r} is invalid; valid: {', '.join(RECOMPUTE)}")
    tps = tp_choices or [t for t in _divisors(gpus) if model.heads % t == 0 and model.groups % t == 0
                         and model.hidden % t == 0 and model.ffn_size % t == 0]
    shape = dict(model=model, gpus=gpus, precision=precision, attention=attention, optimizer=optimizer,
                 state_dtype=state_dtype, float8=float8, fp8_gather=fp8_gather, step=step, zero=zero_template)

    def search_layout(tp: int, cp: int, offload_optimizer: str, offload_params: str) -> list:
        found = []
        dp = gpus // (tp * cp)
        step_batch = global_batch if batch_per_gpu is None else batch_per_gpu * dp
        if step_batch % dp:
            return found  # the global batch must split evenly over the DP ranks
        for policy in recomputes:
            if policy == "selective" and cp > 1:
                continue  # the estimator refuses selective recomputation with context parallelism
            activation_options = [ZeroChoice(0)]
            if tp > 1 and policy == "full" and not step.sequence_parallel:  # Pa slices what SP slices already
                activation_options += [ZeroChoice(0, pa=True), ZeroChoice(0, pa=True, pa_cpu=True)]
            for stage in stages:
                if (offload_optimizer != "none" and stage == 0) or (offload_params != "none" and stage != 3):
                    continue
                for option in activation_options:
                    zero = ZeroChoice(stage, option.pa, option.pa_cpu, offload_optimizer, offload_params)
                    modes = [""]
                    m = node_split(cluster, gpus, tp)
                    if not zero.offloaded and zero.offload_params == "none" and cp == 1 and m is not None:
                        modes += [z for z in PLANNER_MODES[stage]
                                  if (m >= 2 or not named_modes(z).needs_two_per_node)
                                  and not (fp8_gather and named_modes(z).gathers_own_format)]
                    for mode in modes:
                        found += _micro_batches(cluster, dict(shape, recompute=policy), tp,
                                                dataclasses.replace(zero, zeropp=mode), step_batch, dp,
                                                bucket_elements, margin_fraction, cp)
        return found

    def search(offload_optimizer: str = "none", offload_params: str = "none") -> list:
        found = []
        for tp in tps:
            # context parallelism: fused attention only, and no per-sample document masks (the engine refuses both)
            cps = valid_context_sizes(model.seq, gpus // tp) if attention == "fused" and not step.document_masks else [1]
            for cp in cps:  # the smallest context degree at which this tp fits (1: no context parallelism)
                at_tp = search_layout(tp, cp, offload_optimizer, offload_params)
                if at_tp:
                    found += at_tp
                    break
        # ties (micro-batch does not change modelled time) go to fewer accumulation steps (larger GEMMs), then to
        # the most memory headroom (the lower total: hybrid's replicas or hpZ's copy rank below plain stage 3)
        return sorted(found, key=lambda c: (-c.samples_per_s, c.accumulation, c.memory.total_bytes))

    found = search()
    for tier in OFFLOAD_TIERS if offload and not found else ():
        found = search(*tier)
        if found:
            break
    return found


def _fp8_gather(shape: dict, zero: ZeroChoice) -> bool:
    return shape.get("fp8_gather", False) and zero.stage == 3


def _micro_batches(cluster: Cluster, shape: dict, tp: int, zero: ZeroChoice, step_batch: int, dp: int,
                   bucket_elements: Optional[int], margin_fraction: float, cp: int = 1) -> list:
    """The fitting candidates of one layout, over the micro-batches that divide the per-rank batch."""
    found = []
    for micro_batch in _divisors(step_batch // dp):
        candidate = _candidate(cluster, shape, tp, zero, micro_batch, step_batch, bucket_elements, margin_fraction,
                               cp)
        if candidate is None:
            break  # a larger micro-batch only needs more memory
        found.append(candidate)
    return found


def _candidate(cluster: Cluster, shape: dict, tp: int, zero: ZeroChoice, micro_batch: int, step_batch: int,
               bucket_elements: Optional[int], margin_fraction: float, cp: int = 1) -> Optional[Candidate]:
    """The layout with its memory and modelled time, or None when it does not fit: `shape` (plan's search: the model,
    gpus, recompute, precision, attention, optimizer, state_dtype, float8, fp8_gather) read once into the analysis's
    objects, `zero` with the search's buckets (and float8 gathers at stage 3)."""
    model, gpus = shape["model"], shape["gpus"]
    layout = layout_on(cluster, gpus, tp, cp)
    template = shape.get("zero") or ZeroChoice(0)
    zero = dataclasses.replace(zero, bucket_elements=bucket_elements, fp8_gather=_fp8_gather(shape, zero),
                               prefetch_units=template.prefetch_units, nvme_buffer_bytes=template.nvme_buffer_bytes)
    base = shape.get("step") or Step(precision=shape["precision"], attention=shape.get("attention", "local"),
                                     float8=shape.get("float8", "none"))
    accumulation = step_batch // (micro_batch * (gpus // (tp * cp)))
    step = dataclasses.replace(base, micro_batch=micro_batch, recompute=shape["recompute"], accumulation=accumulation,
                               sequence_parallel=base.sequence_parallel and tp > 1, grad_shard_per_step=accumulation == 1)
    optimizer = OptimizerStates.of_shape(model, tp, shape.get("optimizer", "adamw"), shape.get("state_dtype", "fp32"))
    memory = estimate(model, layout, zero, step, Budget(cluster.gpu_memory_bytes, margin_fraction), optimizer)
    offload = None
    if zero.offloaded:
        offload = offload_breakdown(memory, layout, zero, step.precision, accumulation=accumulation,
                                    optimizer=optimizer)
        memory = offload.device
        if not cluster.holds_offload(offload, gpus, margin_fraction):
            return None
    if not memory.fits:
        return None
    timing = step_time(cluster, model, layout, zero, step, step_batch, memory.params_per_rank,
                       offload.pcie_bytes_per_step if offload else 0.0, shape.get("optimizer", "adamw"))
    return Candidate(tp=tp, zero=zero, micro_batch=micro_batch, memory=memory, offload=offload, cp=cp, step=step,
                     **timing)


def format_candidates(candidates: list, top: int = 10) -> str:
    """One line per layout: memory, modelled TFLOP/s per GPU and where the step time goes."""
    lines = []
    for c in candidates[:top]:
        lines.append(f"  tp {c.tp:<3}" + (f" cp {c.cp:<3}" if c.cp > 1 else "") + f" dp {c.dp:<4} {c.zero.label:<24} "
                     f"micro-batch {c.micro_batch:<3} "
                     f"x{c.accumulation:<3} B {c.global_batch:<5} {c.memory.total_bytes / 1e9:5.1f} GB  "
                     f"{c.tflops_per_gpu:5.1f} TFLOP/s/GPU  step {c.step_s:7.2f} s "
                     f"(compute {c.compute_s:.2f}, "
                     f"MP {c.mp_s:.2f}, Pa {c.pa_s:.2f}, cpu {c.offload_s:.2f}, DP {c.dp_s:.2f}"
                     + (f", CP {c.cp_s:.2f}" if c.cp > 1 else "")
                     + (f", PCIe {c.pcie_s:.2f}; host {c.offload.host_bytes / 1e9:.1f} GB, NVMe "
                        f"{c.offload.nvme_bytes / 1e9:.1f} GB, PCIe {c.offload.pcie_bytes_per_step / 1e9:.1f} GB/step)"
                        if c.offload else ")") + (f" recompute {c.step.recompute}" if c.step else "")
                     + (" + SP" if c.step and c.step.sequence_parallel else ""))
    return "\n".join(lines) if lines else "  no layout fits (or the global batch splits over no DP degree)"


@dataclass(frozen=True)
class MaxModel:
    """The deepest model that fits at a fixed hidden size, and its total parameter count."""

    hidden: int
    layers: int
    params: int  # whole model (tp = 1 count), embeddings included
    memory: Optional[MemoryBreakdown]


def max_model_size(*, hidden: int, heads: int, gpus: int, tp: int, stage: int, micro_batch: int,
                   vocab: int = GPT2_VOCAB, seq: int = PAPER_SEQ, pa: bool = False, pa_cpu: bool = False,
                   recompute: str = "full", bucket_elements: Optional[int] = DEFAULT_BUCKET_ELEMENTS,
                   precision: str = "fp16", gpu_memory_bytes: float = V100_MEMORY_BYTES,
                   margin_fraction: float = DEFAULT_MARGIN_FRACTION) -> MaxModel:
    """Largest layer count whose per-GPU memory fits (memory grows with layers, so bisect)."""

    def memory(layers: int) -> MemoryBreakdown:
        return estimate_from_shape(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, gpus=gpus,
                                   tp=tp, stage=stage, micro_batch=micro_batch, recompute=recompute, pa=pa,
                                   pa_cpu=pa_cpu, bucket_elements=bucket_elements, precision=precision,
                                   gpu_memory_bytes=gpu_memory_bytes, margin_fraction=margin_fraction)

    layers = largest_fitting_layers(lambda n: memory(n).fits)
    if not layers:
        return MaxModel(hidden, 0, 0, None)
    return MaxModel(hidden, layers, gpt_param_count(layers, hidden, vocab, seq), memory(layers))


# Figure 7 / Table IV shapes for the data-parallel-only study: (hidden, heads)
DP_ONLY_SHAPES = ((1536, 16), (1920, 16), (2304, 24), (3072, 24), (4096, 32))
DP_ONLY_GPUS = 128
MP_STUDY = dict(hidden=8192, heads=64, gpus=400, tp=16, micro_batch=16)  # Figure 5 (appendix Figure 4)


def dp_only_limit(stage: int, cluster: Cluster = PAPER_CLUSTER, micro_batch: int = 1) -> MaxModel:
    """Largest model without MP over the Figure 7 hidden sizes; stage 0 carries the 4Ψ fused buffer
    (no CB: PyTorch DDP / apex fp32 master gradients), ZeRO stages use CB."""
    bucket = None if stage == 0 else DEFAULT_BUCKET_ELEMENTS
    best = [max_model_size(hidden=h, heads=a, gpus=DP_ONLY_GPUS, tp=1, stage=stage, micro_batch=micro_batch,
                           bucket_elements=bucket, gpu_memory_bytes=cluster.gpu_memory_bytes)
            for h, a in DP_ONLY_SHAPES]
    return max(best, key=lambda m: m.params)


def config_limits(cluster: Cluster = PAPER_CLUSTER) -> dict:
    """C1–C5 maxima at MP 16 on 400 GPUs, batch 16 per GPU, hidden 8192, recompute full, CB + MD."""
    return {name: max_model_size(stage=z.stage, pa=z.pa, pa_cpu=z.pa_cpu,
                                 gpu_memory_bytes=cluster.gpu_memory_bytes, **MP_STUDY)
            for name, z in PAPER_CONFIGS.items()}
