"""Per-phase, per-category memory peaks of one rank's training steps (torch's MemTracker, extended)."""
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

PHASES = ("forward", "backward", "reduction", "optimizer step", "gather")
# Phases after backward: what they allocate is scratch (MemTracker would call it activations).
STEP_PHASES = ("reduction", "optimizer step", "gather")
CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
# MemTracker's reference types → the paper's categories (buffers are megatron's few registered buffers).
CATEGORY_OF = {_MemRefType.PARAM: "params", _MemRefType.BUFFER: "params", _MemRefType.GRAD: "grads",
               _MemRefType.OPT: "optimizer", _MemRefType.ACT: "activations",
               _MemRefType.TEMP: "temporaries", _MemRefType.OTH: "temporaries"}


def _storages(tensors: list) -> list:
    """The storages of `tensors`, each once."""
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        if not any(storage is seen for seen in out):
            out.append(storage)
    return out


class StepPhases:
    """Which phase of a training step is running; the probe moves it, the tracker and clock read it."""

    def __init__(self):
        self.current = "setup"
        self.listeners: list[Callable[[str, str], None]] = []

    def enter(self, phase: str) -> None:
        if phase != self.current:
            previous, self.current = self.current, phase
            for listener in self.listeners:
                listener(previous, phase)


@dataclass
class Collective:
    """One collective this rank issued: the op, its payload bytes (whole tensor) and its group."""

    op: str
    nbytes: int
    ranks: tuple
    phase: str


@dataclass
class PhasePeak:
    device_bytes: int = 0
    by_category: dict = field(default_factory=dict)


def _process_group(arg) -> Optional[dist.ProcessGroup]:
    """The ProcessGroup a c10d op was given (a boxed ScriptObject at the dispatcher), else None."""
    if isinstance(arg, dist.ProcessGroup):
        return arg
    if isinstance(arg, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(arg)
        except RuntimeError:  # the op's other boxed argument, its ReduceOp
            return None
    return None


class PhaseMemTracker(MemTracker):
    """MemTracker whose peaks are kept per step phase, with device and host memory apart.

    - Tensors first allocated during reduction, optimizer step or gather count as temporaries.
    - The gradient shards the engine allocates for a step (stages 2/3: `grad_shard`) count as grads.
    - Stage 3's gathered parameters (`gathered_now()`: the units' full buffers) count as temporaries whenever
      they were gathered (MemTracker would call a unit params, or activations when a recomputation gathered
      it): the estimator's "gathered units" buffer term.
    - `host_bytes_now()` is the host memory inside the simulated device's snapshot, per category
      (Pa+cpu checkpoints: activations; ZeRO-Offload: optimizer, params) plus "untracked" host bytes
      that never were in it; it is taken out of the device figures (on a real GPU host tensors sit on
      the CPU device and are reported from there).
    - Collectives (c10d ops) are logged with their payload and group, for the α-β model.
    """

    def __init__(self, phases: StepPhases, device: torch.device,
                 host_bytes_now: Optional[Callable[[], dict]] = None):
        super().__init__()
        self.phases, self.device = phases, device
        self.host_bytes_now = host_bytes_now or dict
        self.gathered_now: Callable[[], list] = list  # register_engine_state: stage 3's gathered buffers
        self.host_tensors_now: Callable[[], dict] = dict  # register_engine_state: {category: placement's host tensors}
        self.allocating_as: Optional[_MemRefType] = None  # register_engine_state: the category of what is allocated
        self.per_step_grad_bytes: dict = {}  # {group name: bytes of the gradient shard a step allocated, as tracked}
        self.phase_peaks = {p: PhasePeak() for p in PHASES}
        self.category_peaks = dict.fromkeys(CATEGORIES, 0)
        self.host_peak = 0
        self.host_category_peaks: dict = {}
        self.collectives: list[Collective] = []

    # ------------------------------------------------------------ registration of engine buffers

    def register(self, category_ref: _MemRefType, *tensors: torch.Tensor) -> None:
        """Count tensors allocated before tracking began under a category (first claim wins)."""
        for t in tensors:
            if t is not None and t.untyped_storage() not in self._WINFO:
                self._update_and_maybe_create_winfos(t, category_ref)

    # ------------------------------------------------------------ MemTracker hooks

    # MemTracker's module hooks keep per-module snapshots (deep copies at every module call, and a
    # refusal of a second iteration); the probe needs only what they do for the categories: track
    # each module's parameters (and their gradients' hooks), and mark recomputation in backward
    # (its tensors are activations, not temporaries).
    def _pre_fw_hook(self, module, inputs) -> None:
        self._track_module_params_and_buffers(module, install_grad_hooks=True)
        if self._mod_tracker.is_bw and self._ac_mod is None:
            self._ac_mod, self._in_ac = weakref.ref(module), True

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        if self._ac_mod is not None and self._ac_mod() is module:
            self._ac_mod, self._in_ac = None, False

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass

    def _track(self, reftype, t):
        if self.allocating_as is not None:
            reftype = self.allocating_as
        # Inside optimizer.step MemTracker calls every new tensor optimizer state; the states proper
        # are re-tagged by its post-step hook, so the rest (the update's scratch) is temporary.
        if (self.phases.current in STEP_PHASES and reftype == _MemRefType.ACT) or reftype == _MemRefType.OPT:
            reftype = _MemRefType.TEMP
        super()._track(reftype, t)

    def _update_peak_stats(self, peak_state) -> None:
        # Replaces MemTracker's per-module bookkeeping (quadratic in modules × ops) by per-phase peaks.
        loose = self.host_bytes_now() if self.device.type == "cpu" else None
        host_now = self._host_now(loose)
        by_category = self.now_by_category(loose)
        host = sum(host_now.values())
        for name, nbytes in host_now.items():
            self.host_category_peaks[name] = max(self.host_category_peaks.get(name, 0), nbytes)
        total = sum(by_category.values())
        for name, nbytes in by_category.items():
            if nbytes > self.category_peaks[name]:
                self.category_peaks[name] = nbytes
        self.host_peak = max(self.host_peak, host)
        peak = self.phase_peaks.get(self.phases.current)
        if peak is not None and total > peak.device_bytes:
            peak.device_bytes, peak.by_category = total, by_category

    def _host_now(self, loose: Optional[dict] = None) -> dict:
        """{category: host bytes}; "untracked": host bytes outside the tracker's snapshot. `loose`: host_bytes_now()
        when the caller has it."""
        if self.device.type != "cpu":
            return {"untracked": self._curr_mem_snap.get(torch.device("cpu"), {}).get(_TOTAL_KEY, 0)}
        out = dict(self.host_bytes_now() if loose is None else loose)
        for category, tensors in self.host_tensors_now().items():
            out[category] = out.get(category, 0) + sum(storage.nbytes() for storage in _storages(tensors))
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self._log_collective(func, args)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _log_collective(self, func, args) -> None:
        tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])
                   if isinstance(t, torch.Tensor)]
        groups = [g for g in map(_process_group, args) if g is not None]
        if not tensors or not groups:
            return
        name = func._opname  # allreduce_, _allgather_base_, _reduce_scatter_base_, reduce_, broadcast_ ...
        # The payload: the full tensor (an all-gather's output, a reduce-scatter's input).
        payload = max(t.numel() * t.element_size() for t in tensors)
        self.collectives.append(Collective(name, payload, tuple(dist.get_process_group_ranks(groups[0])),
                                           self.phases.current))

    # ------------------------------------------------------------ results

    def now_by_category(self, loose: Optional[dict] = None) -> dict:
        """Device bytes per category right now (model states between steps, when called then); `loose`:
        host_bytes_now() when the caller has it."""
        snap = self._curr_mem_snap.get(self.device, {})
        out = dict.fromkeys(CATEGORIES, 0)
        for ref, nbytes in snap.items():
            if ref != _TOTAL_KEY:
                out[CATEGORY_OF[ref]] += nbytes
        for category, nbytes in self._gathered_by_category():
            out[category] -= nbytes
            out["temporaries"] += nbytes
        if self.device.type == "cpu":  # host memory sits in the same snapshot: taken out
            for category, nbytes in (self.host_bytes_now() if loose is None else loose).items():
                if category in out:
                    out[category] -= nbytes
            # the placement's host tensors out of whichever category they were tracked under (the moments a first
            # step creates, say, are its temporaries until the step ends)
            for storage in _storages([t for ts in self.host_tensors_now().values() for t in ts]):
                winfo, _ = self._WINFO.get(storage, (None, None))
                if winfo is not None and winfo.device == self.device:
                    out[CATEGORY_OF[winfo.reftype]] -= winfo.mem_consumed
        return out

    def _gathered_by_category(self) -> list:
        """[(category it was tracked under, bytes)] of each gathered parameter buffer on this device."""
        out = []
        for t in self.gathered_now():
            winfo, _ = self._WINFO.get(t.untyped_storage(), (None, None))
            if winfo is not None and winfo.device == self.device:
                out.append((CATEGORY_OF[winfo.reftype], winfo.mem_consumed))
        return out

    def peak(self) -> tuple[str, PhasePeak]:
        """(phase, its peak) of the phase that reaches the highest device bytes."""
        phase = max(PHASES, key=lambda p: self.phase_peaks[p].device_bytes)
        return phase, self.phase_peaks[phase]


def register_engine_state(tracker: PhaseMemTracker, engine) -> None:
    """The engine's buffers, allocated before tracking: parameters, gradients, fp32 masters."""
    tracker.track_external(engine.model)
    units = getattr(engine, "units", ())  # stage 3: gather units, `full` while gathered
    tracker.gathered_now = lambda: [full for unit in units if unit.full for full in unit.full]
    allocate = engine.grad_shard

    def grad_shard(group):
        fresh = group.grads is None
        tracker.allocating_as = _MemRefType.GRAD
        try:
            shard = allocate(group)
        finally:
            tracker.allocating_as = None
        winfo, _ = tracker._WINFO.get(shard.untyped_storage(), (None, None))
        if fresh and winfo is not None:
            tracker.per_step_grad_bytes[group.name] = winfo.mem_consumed
        return shard
    engine.grad_shard = grad_shard
    for g in engine.groups.values():
        tracker.register(_MemRefType.PARAM, g.param_flat)
        tracker.register(_MemRefType.GRAD, g.grads)  # None: allocated per step, by grad_shard
        if g.secondary is not None:  # stage 3 hpZ: the node-local copy of the parameters
            tracker.register(_MemRefType.PARAM, g.secondary)
        for _, piece in g.master_pieces:  # one tensor, or per-bucket views of the fp32 parameters
            tracker.register(_MemRefType.OPT, piece)
    tracker.host_tensors_now = engine.placement.host_tensors  # ZeRO-Offload's host tensors
    if engine.placement.name != "nvme":  # (whose states are in its files)
        # the optimizer's states made now, as its first step would (zeros, step 0): made inside that step they would be
        # its temporaries there (and the host optimizer's device memory until listed as the placement's), where the
        # second step's peak, as high, holds them as optimizer states
        optimizer = engine.placement.optimizer
        for group in optimizer.param_groups:
            for piece in group["params"]:
                if not optimizer.state[piece]:
                    optimizer.state[piece].update(optimizer.initial_state(piece))
