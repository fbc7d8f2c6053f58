"""ZeRO-R activation checkpoints (paper §2.5, §3.5): Pa, Pa+cpu and MD, for per-layer recomputation."""
from fractions import Fraction
from typing import Callable, Optional

import torch

from zero3d.comm.core import Comm, CommStats

TAG = "activations"


def _get_rng_states(tracker_fn):
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    tracker = dict(tracker_fn().get_states()) if tracker_fn is not None else None
    return torch.get_rng_state(), cuda, tracker


def _set_rng_states(states, tracker_fn):
    cpu, cuda, tracker = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    if tracker is not None:
        tracker_fn().set_states(dict(tracker))  # a copy: forks inside the recompute mutate the dict


class ContiguousBuffer:
    """MD: one flat allocation holding a micro-batch's checkpoints back to back (a bump allocator).

    Slots are (offset, numel); the write offset returns to 0 once every slot is released, so the
    next micro-batch reuses the same memory. Growing (rare) copies the live prefix to the new buffer.
    """

    def __init__(self, device: torch.device, pin: bool):
        self.device, self.pin = device, pin
        self.buffer: Optional[torch.Tensor] = None
        self.offset = 0
        self.live = 0
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel() * self.buffer.element_size()

    def reserve(self, numel: int, dtype: torch.dtype, sync: Callable = lambda: None) -> None:
        """Make room for `numel` more elements after the current offset (one allocation if short)."""
        if self.buffer is not None and self.buffer.dtype != dtype:
            if self.live:
                raise RuntimeError(f"MD buffer holds live {self.buffer.dtype} checkpoints; got {dtype}")
            self.buffer = None
        if self.buffer is not None and self.offset + numel <= self.buffer.numel():
            return
        new = torch.empty(self.offset + numel, dtype=dtype, device=self.device, pin_memory=self.pin)
        if self.buffer is not None and self.offset:
            sync()  # pending copies into the old buffer must land before it is copied
            new[:self.offset].copy_(self.buffer[:self.offset])
        self.buffer = new
        self.allocations += 1

    def take(self, numel: int, dtype: torch.dtype, sync: Callable) -> int:
        self.reserve(numel, dtype, sync)
        start = self.offset
        self.offset += numel
        self.live += 1
        return start

    def view(self, start: int, numel: int) -> torch.Tensor:
        return self.buffer[start:start + numel]

    def release(self) -> None:
        self.live -= 1
        if self.live == 0:
            self.offset = 0


class _Slot:
    """One stored checkpoint: a tensor, or a range of the MD buffer. Releases itself when dropped."""

    def __init__(self, acts, shape, numel, nbytes, on_host, tensor=None, start=None, event=None):
        self.acts, self.shape, self.numel, self.nbytes, self.on_host = acts, shape, numel, nbytes, on_host
        self.tensor, self.start, self.event, self.released = tensor, start, event, False

    def stored(self) -> torch.Tensor:
        return self.tensor if self.start is None else self.acts._buffer.view(self.start, self.numel)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.tensor = None
            self.acts._forget(self)

    def __del__(self):  # a graph dropped without backward must not leak its accounting or MD space
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class ActivationCheckpointing:
    """Settings (Pa, Pa+cpu, MD) + storage + accounting of the activation checkpoints of one model.

    tp_group: the tensor-parallel group the checkpoints are sliced over (None: no TP).
    comm_stats: where the all-gathers are recorded (the engine's, so comm/* metrics include them).
    rng_tracker: callable returning megatron's RNG tracker (get_states/set_states), or None.
    """

    def __init__(self, partition: bool = False, cpu: bool = False, contiguous: bool = False,
                 tp_group=None, comm_stats: Optional[CommStats] = None, rng_tracker: Optional[Callable] = None):
        if cpu and not partition:
            raise ValueError("cpu checkpointing (Pa+cpu) needs partition=True (it offloads the Pa slices)")
        self.partition, self.cpu, self.contiguous = partition, cpu, contiguous
        self.comm_stats = comm_stats if comm_stats is not None else CommStats()
        self.tp = Comm(tp_group, self.comm_stats) if tp_group is not None else None
        self.tp_size = self.tp.size if self.tp is not None else 1
        self.tp_rank = self.tp.rank if self.tp is not None else 0
        self.rng_tracker = rng_tracker
        self._buffer: Optional[ContiguousBuffer] = None
        self._side_stream = None
        self.device_bytes = self.host_bytes = 0
        self.checkpoints = 0
        self.reset_step()

    def record_into(self, stats: CommStats) -> None:
        """Count the all-gathers in `stats` (the engine's, built after the model), so comm/* holds them all."""
        self.comm_stats = stats
        if self.tp is not None:
            self.tp = Comm(self.tp.group, stats)

    # ------------------------------------------------------------------ accounting
    def reset_step(self) -> None:
        """Start a step: peaks restart from the current usage; the all-gather count from 0."""
        self.peak_device_bytes, self.peak_host_bytes = self.device_bytes, self.host_bytes
        self.allgather_elements = Fraction(0)
        self.allgathers = 0

    def report(self) -> dict:
        """Per-rank metrics of this step: stored checkpoint bytes (peak and now) and extra comm."""
        return {"act/ckpt_device_bytes": self.peak_device_bytes, "act/ckpt_host_bytes": self.peak_host_bytes,
                "act/ckpt_device_bytes_now": self.device_bytes, "act/ckpt_host_bytes_now": self.host_bytes,
                "act/allgather_elements": float(self.allgather_elements), "act/allgathers": self.allgathers,
                "act/md_buffer_bytes": self._buffer.nbytes if self._buffer else 0,
                "act/md_allocations": self._buffer.allocations if self._buffer else 0}

    def slice_numel(self, numel: int) -> int:
        """Elements stored per rank for a checkpoint of `numel` elements: ⌈numel/TP⌉ under Pa."""
        return -(-numel // self.tp_size) if self.partition else numel

    @property
    def buffer(self) -> Optional[ContiguousBuffer]:
        return self._buffer

    # ------------------------------------------------------------------ storage
    def _sync_side(self):
        if self._side_stream is not None:
            self._side_stream.synchronize()

    def _md(self, device: torch.device) -> ContiguousBuffer:
        if self._buffer is None:
            host = torch.device("cpu")
            self._buffer = ContiguousBuffer(host if self.cpu else device, pin=self.cpu and device.type == "cuda")
        return self._buffer

    def reserve(self, num_checkpoints: int, hidden_states: torch.Tensor) -> None:
        """MD: size the buffer for `num_checkpoints` checkpoints shaped like `hidden_states` at once."""
        if self.contiguous:
            need = num_checkpoints * self.slice_numel(hidden_states.numel())
            self._md(hidden_states.device).reserve(need, hidden_states.dtype, self._sync_side)

    def _save(self, hidden: torch.Tensor) -> _Slot:
        x = hidden.detach()
        n, k, esize = x.numel(), self.slice_numel(x.numel()), x.element_size()
        sliced = self.partition and self.tp_size > 1
        if sliced:
            flat = x.reshape(-1)
            lo = min(self.tp_rank * k, n)
            piece = flat[lo:min(lo + k, n)]
            if piece.numel() < k:  # the tail of the last rank(s): zero padding up to ⌈n/TP⌉
                piece = torch.cat([piece, piece.new_zeros(k - piece.numel())])
        else:
            piece = x.reshape(-1)
        if not self.cpu and not self.contiguous:
            # Plain checkpointing keeps the input itself; Pa keeps a fresh slice so the input can go.
            kept = piece.clone() if sliced else x
            return self._account(_Slot(self, x.shape, k, k * esize, on_host=False, tensor=kept))
        on_cuda = x.device.type == "cuda"
        if self.contiguous:
            md = self._md(x.device)
            start = md.take(k, x.dtype, self._sync_side)
            dst, slot = md.view(start, k), _Slot(self, x.shape, k, k * esize, self.cpu, start=start)
        else:
            dst = torch.empty(k, dtype=x.dtype, device="cpu", pin_memory=on_cuda)
            slot = _Slot(self, x.shape, k, k * esize, on_host=True, tensor=dst)
        if self.cpu and on_cuda:  # device → pinned host, off the compute stream
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(device=x.device)
            self._side_stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(self._side_stream):
                dst.copy_(piece, non_blocking=True)
                slot.event = self._side_stream.record_event()
            piece.record_stream(self._side_stream)
        else:
            dst.copy_(piece)
        return self._account(slot)

    def _account(self, slot: _Slot) -> _Slot:
        self.checkpoints += 1
        if slot.on_host:
            self.host_bytes += slot.nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        else:
            self.device_bytes += slot.nbytes
            self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        return slot

    def _forget(self, slot: _Slot) -> None:
        self.checkpoints -= 1
        if slot.on_host:
            self.host_bytes -= slot.nbytes
        else:
            self.device_bytes -= slot.nbytes
        if slot.start is not None:
            self._buffer.release()

    def _load(self, slot: _Slot, device: torch.device) -> torch.Tensor:
        """The full checkpoint on `device`: back from the host if offloaded, all-gathered under Pa."""
        stored = slot.stored()
        if slot.on_host and device.type == "cuda":
            if slot.event is not None:
                torch.cuda.current_stream(device).wait_event(slot.event)
            stored = stored.to(device, non_blocking=True)
        n = 1
        for d in slot.shape:
            n *= d
        if self.partition and self.tp_size > 1:
            full = torch.empty(slot.numel * self.tp_size, dtype=stored.dtype, device=device)
            self.tp.all_gather(full, stored, tag=TAG)
            self.allgather_elements += Fraction(full.numel() * (self.tp_size - 1), self.tp_size)
            self.allgathers += 1
            stored = full
        return stored.reshape(-1)[:n].view(slot.shape)


class _CheckpointFunction(torch.autograd.Function):
    """Reentrant checkpoint (as megatron's CheckpointFunction) storing the input through `acts`."""

    @staticmethod
    def forward(ctx, run_function, acts, hidden, *rest):
        ctx.run_function, ctx.acts = run_function, acts
        ctx.rng_states = _get_rng_states(acts.rng_tracker)
        with torch.no_grad():
            outputs = run_function(hidden, *rest)
        ctx.slot = acts._save(hidden)
        ctx.device, ctx.hidden_requires_grad = hidden.device, hidden.requires_grad
        ctx.tensor_index = [i for i, a in enumerate(rest) if torch.is_tensor(a)]
        ctx.rest = [None if torch.is_tensor(a) else a for a in rest]
        ctx.save_for_backward(*(rest[i] for i in ctx.tensor_index))
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("zero3d checkpointing is not compatible with .grad(); use .backward()")
        acts = ctx.acts
        rest = list(ctx.rest)
        for i, t in zip(ctx.tensor_index, ctx.saved_tensors):
            rest[i] = t.detach().requires_grad_(t.requires_grad)
        hidden = acts._load(ctx.slot, ctx.device).detach().requires_grad_(ctx.hidden_requires_grad)
        outer = _get_rng_states(acts.rng_tracker)
        try:
            _set_rng_states(ctx.rng_states, acts.rng_tracker)  # same dropout masks as the forward
            with torch.enable_grad():
                outputs = ctx.run_function(hidden, *rest)
        finally:
            _set_rng_states(outer, acts.rng_tracker)
        outputs = (outputs,) if torch.is_tensor(outputs) else outputs
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.slot.release()
        ctx.slot = None
        return (None, None, hidden.grad) + tuple(a.grad if torch.is_tensor(a) else None for a in rest)


def checkpoint(function: Callable, acts: ActivationCheckpointing, hidden_states: torch.Tensor, *rest):
    """function(hidden_states, *rest), recomputed in backward from the checkpoint `acts` stores."""
    if not torch.is_grad_enabled():
        return function(hidden_states, *rest)
    return _CheckpointFunction.apply(function, acts, hidden_states, *rest)
