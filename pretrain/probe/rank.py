"""One rank of a configured job, set up on the fake process group and run for whole training steps of
pretrain's own code, on fake tensors or (--real) real ones, under the phase/category memory tracker."""
import contextlib
import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

import megatron_patches
from pretrain.config import Config, ConfigError
from pretrain.data.loader import Batches
from pretrain.runtime.layout import Layout, destroy_layout, init_layout, start_fake
from pretrain.step import train_step
from pretrain.train import build_and_wrap
from pretrain.probe.kernels import kernel_profile
from pretrain.probe.rank_memory import PHASES, PhaseMemTracker, StepPhases, register_engine_state
from zero3d.accounting import step_counter_bytes
from zero3d.comm.modes import quantized_settings

# Fake tensors hold no values; the engine's one host read (the squared gradient norm) gets this
# finite value, so every step takes the non-overflow path (clip, optimizer step, publish).
FAKE_SQUARED_GRAD_NORM = 1.0
_state: dict = {}  # what probe_rank set up and release_layout undoes


class SyntheticTokens:
    """Token blocks of the right shape (the probe measures memory and time, not learning), with the per-sample
    `fields` of document boundaries (DataConfig.document_fields) shaped and typed as megatron's dataset gives them."""

    def __init__(self, vocab: int, seq_length: int, fields: tuple[str, ...] = ()):
        self.vocab, self.seq_length, self.fields = vocab, seq_length, fields

    def sample(self, i: int):
        block = (torch.arange(self.seq_length + 1) * (i % 7 + 1) + i) % self.vocab
        if not self.fields:
            return block
        s = self.seq_length
        made = {"position_ids": lambda: torch.arange(s), "loss_mask": lambda: torch.ones(s),
                "attention_mask": lambda: torch.ones(1, s, s, dtype=torch.bool).triu(1)}
        return {"tokens": block, **{name: made[name]() for name in self.fields}}


@contextlib.contextmanager
def casts_by_set_data():
    """nn.Module.to for fake parameters: torch (2.13) swaps each fake parameter, which fails on the
    weak references fake tensors carry, so the probe casts them by `param.data = ...` instead —
    the same result (dtype and device of every floating parameter and buffer) as Module.to."""
    original = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        for module in self.modules():
            for p in module._parameters.values():
                if p is not None:
                    p.data = p.data.to(device=device, dtype=dtype if p.is_floating_point() else None)
            for key, b in module._buffers.items():
                if b is not None:
                    module._buffers[key] = b.to(device=device, dtype=dtype if b.is_floating_point() else None)
        return self

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


def release_layout() -> None:
    """Undo probe_rank's init_layout: megatron's groups, the process group, and the CPU patches it applied."""
    destroy_layout()
    if _state.pop("undo_cpu_patches", False):
        megatron_patches.undo_cpu_patches()


class PhaseClock:
    """Wall time per phase, summed over the steps run while `timing` is on (the device is synchronised at every
    phase change)."""

    def __init__(self, phases: StepPhases, device: torch.device):
        self.device, self.seconds = device, dict.fromkeys(PHASES, 0.0)
        self.timing = True
        self._since = time.perf_counter()
        phases.listeners.append(self._on_change)

    def _on_change(self, previous: str, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if self.timing and previous in self.seconds:
            self.seconds[previous] += now - self._since
        self._since = now


def timed_steps(steps: int) -> range:
    """The steps whose phases the probe times: all but the first of two or more. The first step is the warm-up: it
    compiles the layers (model.compile), grows the caching allocator and picks the GEMM and attention kernels, which
    the rank's steady steps do not; with one step, that step."""
    return range(1 if steps > 1 else 0, steps)


class CudaPhasePeaks:
    """--real on a GPU: the caching allocator's peak per phase (reset at every phase change), with no
    dispatch-mode tracker in the way of the timings; categories there come from the engine's accounting."""

    def __init__(self, phases: StepPhases, device: torch.device):
        self.device, self.peaks = device, dict.fromkeys(PHASES, 0)
        torch.cuda.reset_peak_memory_stats(device)
        self.overall = 0
        phases.listeners.append(self._on_change)

    def _on_change(self, previous: str, phase: str) -> None:
        peak = torch.cuda.max_memory_allocated(self.device)
        self.overall = max(self.overall, peak)
        if previous in self.peaks:
            self.peaks[previous] = max(self.peaks[previous], peak)
        torch.cuda.reset_peak_memory_stats(self.device)


@dataclass
class RankRun:
    """What one rank's probed steps measured (bytes are per rank, on its device unless 'host')."""

    steps: int
    micro_batches: int
    peak_phase: str
    peak_bytes: int
    peak_by_category: dict  # the categories at the moment of the peak
    category_peaks: dict  # each category's own maximum over the steps
    phase_peaks: dict  # phase -> device bytes
    model_states: dict  # tracker categories after the last step
    engine_state_bytes: dict  # engine.state_bytes() (the training loop's accounting)
    optimizer_step_counter_bytes: int  # Adam's 0-dim step tensors (host memory on a GPU)
    host_peak_bytes: int
    activation_report: dict
    collectives: list
    phase_seconds: dict  # summed over the timed steps (timed_steps)
    timed_steps: int  # how many steps phase_seconds covers: all but the warm-up's first of two or more
    step_seconds: list = field(default_factory=list)  # every step's, the warm-up's first included
    cuda_max_allocated: Optional[int] = None
    bucket_staging_peak_bytes: Optional[int] = None  # stages 2-3: the engine's own count of its buckets
    profile: Optional[dict] = None  # --profile: one more step's kernels (pretrain.probe.kernels.summarize)
    # ZeRO-Offload: device -> host and host -> device bytes per step
    host_traffic_per_step: dict = field(default_factory=dict)
    host_peak_by_category: dict = field(default_factory=dict)  # activations (Pa+cpu), optimizer, params, untracked


def host_bytes(acts, engine):
    """Host memory now that is not the placement's own tensors (`Placement.host_tensors`, which the tracker reads
    itself), by the tracker category it would otherwise count under: the Pa+cpu checkpoints (the MD buffer when there
    is one, else the slices) and stage 3's offloaded parameter shards; NVMe's stream buffers, never tracked."""
    # asked at every dispatched op: the engine's accounting (a walk over every buffer) only where states are on the host
    offloaded = any(key.startswith("host_") for key in engine.state_bytes())

    def now() -> dict:
        out = {"activations": 0}
        if acts is not None and acts.cpu:
            out["activations"] = acts.buffer.nbytes if acts.contiguous and acts.buffer is not None else acts.host_bytes
        if offloaded:  # the placement keeps states in host memory (its own tensors: tracker.host_tensors_now)
            state = engine.state_bytes()
            out["params"] = state.get("host_params", 0)
            out["untracked"] = state.get("host_buffers", 0)
        return out
    return now


def refuse_what_fake_tensors_cannot_run(cfg: Config, fake: bool) -> None:
    """What fake tensors cannot run: the NVMe placements' file I/O, quantization scales (data)."""
    z = cfg.zero
    if fake and "nvme" in (z.offload_optimizer, z.offload_params):
        raise ConfigError(f"probe: zero.offload_optimizer = {z.offload_optimizer!r}, zero.offload_params = "
                          f"{z.offload_params!r}: the NVMe placements do file I/O, which fake tensors cannot "
                          "do; probe with \"cpu\" (the device side is the same code) or with --real")
    quantized = quantized_settings(z)
    if fake and quantized:  # a block's scale is its values' maximum: fake tensors hold no values
        raise ConfigError(f"probe: {', '.join(quantized)}: the quantization scales are data, which fake tensors "
                          "do not hold; probe with --real, or without quantization (it adds no model states)")


def read_fake_step_floats(values: torch.Tensor) -> list[float]:
    """The engine's one host read on fake tensors, which hold no values: [squared gradient norm, loss sum, stop
    requests, saves written] as FAKE_SQUARED_GRAD_NORM and zeros. The zeros are what every rank sums in the probe
    (no stop is requested, no save is pending), and a finite stand-in for the loss."""
    return [FAKE_SQUARED_GRAD_NORM] + [0.0] * (values.numel() - 1)


def run_rank_steps(cfg: Config, topo: Layout, steps: int, fake: bool, profile_to: Optional[str] = None) -> RankRun:
    """Build, wrap and train `steps` steps on this rank with the loop's own step (pretrain.step), under the tracker.
    `profile_to` (real tensors): then one more step under torch.profiler, its chrome trace gzipped there; the
    measurements above are the `steps`' alone."""
    refuse_what_fake_tensors_cannot_run(cfg, fake)
    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode() if fake else contextlib.nullcontext()
    seams = {}
    if fake:
        seams["read_host_floats"] = read_fake_step_floats
    if topo.device.type == "cpu":
        # Fake and CPU ranks stand in for a CUDA rank: the optimizer's fused kernels (AdamW's), not the CPU's
        # foreach ones, whose sqrt/div temporaries (2 × 4 bytes per element of the shard) a GPU never holds; the
        # layers' CUDA kernels (fused SwiGLU, RMSNorm), not the CPU's composites, which keep fp32 copies and the
        # gate's activation for backward (+75-86% of a Llama layer's activations, where a GPU keeps the estimator's).
        seams["fused_optimizer"] = seams["cuda_kernels"] = True
    with fake_mode:
        with casts_by_set_data() if fake else contextlib.nullcontext():
            model, engine, acts = build_and_wrap(cfg, topo, **seams)
        phases = StepPhases()
        on_gpu = topo.device.type == "cuda"
        tracker = PhaseMemTracker(phases, topo.device, host_bytes(acts, engine))
        register_engine_state(tracker, engine)
        clock = PhaseClock(phases, topo.device)
        cuda_peaks = CudaPhasePeaks(phases, topo.device) if on_gpu else None
        model.register_forward_pre_hook(lambda *_: phases.enter("forward"))
        model.register_forward_hook(lambda *_: phases.enter("backward"))
        engine.optimizer.register_step_pre_hook(lambda *_: phases.enter("optimizer step"))
        engine.optimizer.register_step_post_hook(lambda *_: phases.enter("gather"))
        batches = Batches(SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_length, cfg.data.document_fields()),
                          cfg.train, cfg.data, topo)
        step_seconds = []
        engine.train()
        # On a GPU the tracker (a Python dispatch mode) would slow every kernel launch: CUDA's own
        # allocator statistics measure there instead.
        copied_before = dict(engine.copier.bytes)  # the offload's set-up copies are not a step's
        with contextlib.nullcontext() if on_gpu else tracker:
            timed = timed_steps(steps)
            for step in range(steps):
                clock.timing = step in timed
                if acts:
                    acts.reset_step()
                t0 = time.perf_counter()
                train_step(engine, batches, step, cfg, topo, on_phase=phases.enter)
                step_seconds.append(time.perf_counter() - t0)
            model_states = tracker.now_by_category()
            # the gradient shards a step allocates (stages 2/3) are model states too, though freed between steps
            model_states["grads"] += sum(tracker.per_step_grad_bytes.values())
        counters = step_counter_bytes(engine.optimizer)
        if on_gpu:
            state = engine.state_bytes()
            model_states = {"params": state["params"], "grads": state["grads"],
                            "optimizer": state["master_params"] + state["optimizer_states"]}
            for p in PHASES:
                tracker.phase_peaks[p].device_bytes = cuda_peaks.peaks[p]
        phase, peak = tracker.peak()
        run = RankRun(
            steps=steps, micro_batches=topo.grad_accum, peak_phase=phase, peak_bytes=peak.device_bytes,
            peak_by_category=peak.by_category, category_peaks=dict(tracker.category_peaks),
            phase_peaks={p: tracker.phase_peaks[p].device_bytes for p in PHASES},
            model_states={k: model_states[k] for k in ("params", "grads", "optimizer")},
            engine_state_bytes=dict(engine.state_bytes()), optimizer_step_counter_bytes=counters,
            host_peak_bytes=tracker.host_peak, activation_report=acts.report() if acts else {},
            collectives=[asdict(c) for c in tracker.collectives],
            phase_seconds=dict(clock.seconds), timed_steps=len(timed), step_seconds=step_seconds,
            cuda_max_allocated=cuda_peaks.overall if on_gpu else None,
            host_traffic_per_step={k: (v - copied_before[k]) // steps for k, v in engine.copier.bytes.items()},
            host_peak_by_category=dict(tracker.host_category_peaks),
            bucket_staging_peak_bytes=getattr(engine, "staging_bytes_peak", None))
        if profile_to:  # after every measurement above was taken: the profiler's step changes none of them
            def profiled_step():
                if acts:
                    acts.reset_step()
                train_step(engine, batches, steps, cfg, topo, on_phase=phases.enter)
            # a whole layer stack's kernels: the top 25 (a compiled layer's casts and norms are kernels of their own)
            run.profile = kernel_profile(profiled_step, topo.device, steps=1, trace_to=profile_to, top=25)
        return run


def cap_device_memory(device: torch.device, cap_bytes: int) -> float:
    """--real on a GPU larger than the simulated one: the caching allocator refuses beyond `cap_bytes`
    (torch.cuda.set_per_process_memory_fraction); returns the fraction set (1.0: no cap needed)."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, cap_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def probe_rank(cfg: Config, world_size: int, rank: int, steps: int, real: bool = False,
               cap_bytes: Optional[int] = None, profile_to: Optional[str] = None) -> RankRun:
    """One rank of the job, set up, probed and torn down (the process can probe again afterwards).
    With `real` on a GPU and `cap_bytes`, the device is capped to the simulated GPU's memory; a rank
    that does not fit raises torch.OutOfMemoryError (the caller reports it as the verdict). `profile_to`:
    run_rank_steps'."""
    device = (torch.device("cuda", torch.cuda.current_device()) if real and torch.cuda.is_available()
              else torch.device("cpu"))
    if device.type == "cuda" and cap_bytes:
        cap_device_memory(device, cap_bytes)
    _state["undo_cpu_patches"] = device.type == "cpu" and not megatron_patches.cpu_patches_applied()
    # the launcher's view of a job that does not exist: this rank, and cluster.gpus_per_node ranks a node
    launch = dict(rank=rank, world_size=world_size, local_rank=0,
                  env={"LOCAL_WORLD_SIZE": str(cfg.cluster.gpus_per_node)})
    topo = init_layout(cfg, launch, device=device, start=start_fake)
    try:
        return run_rank_steps(cfg, topo, steps, fake=not real, profile_to=profile_to)
    finally:
        release_layout()


def rss_bytes() -> int:
    """Peak resident set of this process (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
