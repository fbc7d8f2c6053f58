"""ZeRO-Infinity for the optimizer: master shards and optimizer states in files, streamed through two host buffers."""
import contextlib
import os
import shutil
import tempfile
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from optim import ADAMW, OptimizerSpec
from optim.config import OptimizerConfig
from optim.flat_optimizer import STATE_TORCH_DTYPES, FlatOptimizer, FlatTensor
from zero3d.offload import Copier, GroupSpec, copy_into_pieces, pinned_empty, scale_
from zero3d.placement import OffDevicePlacement

CHUNK_ALIGN = 4096  # elements: chunk boundaries stay aligned for the vectorised optimizer kernel
FP32 = 4


def file_states(optimizer_spec: OptimizerSpec, state_dtype: str = "fp32") -> dict:
    """One file per group for each of these, {name: dtype}: the master (fp32), then the optimizer's states."""
    return {"master": torch.float32, **{s: STATE_TORCH_DTYPES[state_dtype] for s in optimizer_spec.states}}


def buffer_bytes_per_element(dtype: torch.dtype, optimizer_spec: OptimizerSpec = ADAMW, state_dtype: str = "fp32") -> int:
    """One buffer holds a chunk of the fp32 master, every optimizer state (in its dtype) and the fp32 gradient, plus
    the compute-dtype copy of the updated parameters when that is not fp32."""
    extra = 0 if dtype == torch.float32 else torch.empty(0, dtype=dtype).element_size()
    return FP32 + optimizer_spec.bytes_per_element(False, state_dtype) + FP32 + extra


def chunk_elements(buffer_bytes: int, dtype: torch.dtype, largest_group: int,
                   optimizer_spec: OptimizerSpec = ADAMW, state_dtype: str = "fp32") -> int:
    """Elements per chunk so two buffers fit `buffer_bytes`; a multiple of CHUNK_ALIGN."""
    per_element = buffer_bytes_per_element(dtype, optimizer_spec, state_dtype)
    chunk = buffer_bytes // (2 * per_element) // CHUNK_ALIGN * CHUNK_ALIGN
    if chunk == 0:
        raise ValueError(f"zero.nvme_buffer_bytes = {buffer_bytes} is too small: two buffers of "
                         f"{CHUNK_ALIGN} elements × {per_element} bytes need at least "
                         f"{2 * CHUNK_ALIGN * per_element}")
    return min(chunk, -(-largest_group // CHUNK_ALIGN) * CHUNK_ALIGN)


def file_backed_copy(t: torch.Tensor, root: str, rank: int) -> torch.Tensor:
    """A copy of `t` in a memory-mapped file under `root` (offload_params = "nvme"): the kernel pages
    it in when a gather reads it and may write it back and evict it when memory is short. The file is
    unlinked once mapped, so its space returns to the disk with the process."""
    directory = tempfile.mkdtemp(prefix=f"zero3d-params-rank{rank}-", dir=root)
    path = os.path.join(directory, "shard.bin")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, max(1, t.numel()) * t.element_size())
        os.close(fd)
        out = torch.from_file(path, shared=True, size=t.numel(), dtype=t.dtype)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    out.copy_(t.reshape(-1))
    return out.view(t.shape)


def _byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (numpy has no bfloat16: its elements are read as raw 16-bit words)."""
    return memoryview((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()).cast("B")


class StateFiles:
    """One raw file per (group, state), in the state's dtype; positional I/O of element ranges.

    The files are unlinked as soon as they are open: the disk space is the process's alone and is
    returned when it exits, however it exits (a killed rank leaves nothing behind)."""

    def __init__(self, root: str, rank: int, numels: dict, states: dict):
        self.dir = Path(tempfile.mkdtemp(prefix=f"zero3d-offload-rank{rank}-", dir=root))
        self.fds, self.sizes = {}, {state: torch.empty(0, dtype=dtype).element_size() for state, dtype in states.items()}
        try:
            for index, (name, numel) in enumerate(numels.items()):
                for state in states:
                    path = self.dir / f"group{index}.{state}.bin"
                    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    self.fds[name, state] = fd
                    os.unlink(path)
                    os.ftruncate(fd, numel * self.sizes[state])  # zeros: the states before the first step
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
        self._finalizer = weakref.finalize(self, _close_all, dict(self.fds))

    def read(self, name: str, state: str, lo: int, out: torch.Tensor) -> None:
        view, offset = _byte_view(out), lo * self.sizes[state]
        while len(view):
            n = os.preadv(self.fds[name, state], [view], offset)
            if n <= 0:
                raise IOError(f"short read of {state} of group {name!r} in {self.dir}")
            view, offset = view[n:], offset + n

    def write(self, name: str, state: str, lo: int, src: torch.Tensor) -> None:
        view, offset = _byte_view(src), lo * self.sizes[state]
        while len(view):
            n = os.pwritev(self.fds[name, state], [view], offset)
            view, offset = view[n:], offset + n

    def close(self) -> None:
        self._finalizer()


def _close_all(fds: dict) -> None:
    for fd in fds.values():
        os.close(fd)


@dataclass
class ChunkBuffer:
    """One of the two host buffers: a chunk of every state, the gradient and the compute-dtype output."""

    states: dict
    grad: torch.Tensor
    staging: Optional[torch.Tensor]

    @classmethod
    def allocate(cls, numel: int, dtype: torch.dtype, device: torch.device, states: dict) -> "ChunkBuffer":
        staging = None if dtype == torch.float32 else pinned_empty(numel, dtype, device)
        return cls({s: pinned_empty(numel, state_dtype, device) for s, state_dtype in states.items()},
                   pinned_empty(numel, torch.float32, device), staging)

    def nbytes(self) -> int:
        tensors = [*self.states.values(), self.grad] + ([self.staging] if self.staging is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Chunk:
    name: str
    group_index: int
    lo: int
    hi: int


class NvmeOffload(OffDevicePlacement):
    """offload_optimizer = "nvme": the same interface as HostOffload (zero3d/offload.py)."""

    name = "nvme"

    def __init__(self, specs: list, config: OptimizerConfig, copier: Copier, nvme_path: str, buffer_bytes: int,
                 rank: int, optimizer_spec: OptimizerSpec = ADAMW):
        if any(s.matrix for s in specs):
            raise ValueError(f"zero.offload_optimizer = 'nvme' with optimizer.name = {optimizer_spec.name!r} is not "
                             "supported: its whole-matrix step needs each matrix's direction at once, which the NVMe "
                             "stream's chunks do not hold; use zero.offload_optimizer = 'cpu'")
        self.copier, device = copier, copier.device
        self.optimizer_spec, self.state_dtype = optimizer_spec, config.state_dtype
        states = file_states(optimizer_spec, config.state_dtype)
        dtype = specs[0].dtype
        self.chunk = chunk_elements(buffer_bytes, dtype, max(s.numel for s in specs), optimizer_spec,
                                    config.state_dtype)
        self.buffers = [ChunkBuffer.allocate(self.chunk, dtype, device, states) for _ in range(2)]
        self.files = StateFiles(nvme_path, rank, {s.name: s.numel for s in specs}, states)
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero3d-nvme")
        # Outside materialized() the engine's master shards are empty placeholders.
        self.masters = {s.name: torch.empty(0, dtype=torch.float32) for s in specs}
        self.steps = {s.name: 0 for s in specs}
        self.written = set()  # groups whose state files hold a stepped or loaded state
        self.optimizer = FlatOptimizer([FlatTensor(self.masters[s.name], s.weight_decay, s.name) for s in specs],
                                       optimizer_spec, config, fused=True)
        for s in specs:
            self._write_initial_master(s)
        self.specs = {s.name: s.released() for s in specs}  # the device master copy can be freed

    def master(self, name: str) -> torch.Tensor:
        return self.masters[name]

    def _write_initial_master(self, spec: GroupSpec) -> None:
        buf = self.buffers[0].states["master"]
        for lo in range(0, spec.numel, self.chunk):
            hi = min(lo + self.chunk, spec.numel)
            self.copier.to_host(buf[:hi - lo], spec.master[lo:hi])
            self.copier.wait_host()
            self.files.write(spec.name, "master", lo, buf[:hi - lo])

    # Gradients stay on the device (the Placement defaults, in the compute dtype) until the step fetches them chunk by
    # chunk, cast to fp32 on their way to the host.

    # ------------------------------------------------------------ step

    def _chunks(self) -> list[Chunk]:
        return [Chunk(name, i, lo, min(lo + self.chunk, s.numel))
                for i, (name, s) in enumerate(self.specs.items())
                for lo in range(0, s.numel, self.chunk)]

    def _read(self, c: Chunk, buf: ChunkBuffer) -> None:
        for state, t in buf.states.items():
            self.files.read(c.name, state, c.lo, t[:c.hi - c.lo])

    def _write(self, c: Chunk, buf: ChunkBuffer) -> None:
        for state, t in buf.states.items():
            self.files.write(c.name, state, c.lo, t[:c.hi - c.lo])

    def step(self, master_grads: dict, coef: float, lr: float, unscale: float = 1.0) -> None:
        """The spec's host step chunk by chunk; the I/O thread reads chunk i+1 (after writing chunk i-1 back) while
        the CPU updates chunk i. `master_grads`: `master_grad`'s (compute-dtype ones unscaled here)."""
        for pg in self.optimizer.param_groups:
            pg["lr"] = lr
        chunks = self._chunks()
        reads = {0: self.io.submit(self._read, chunks[0], self.buffers[0])}
        writes = []
        for i, c in enumerate(chunks):
            if i + 1 < len(chunks):  # queued behind chunk i-1's write, which used the same buffer
                reads[i + 1] = self.io.submit(self._read, chunks[i + 1], self.buffers[(i + 1) % 2])
            reads.pop(i).result()
            buf = self.buffers[i % 2]
            self._update(c, buf, master_grads[c.name], coef, unscale)
            writes.append(self.io.submit(self._write, c, buf))
        for w in writes:
            w.result()
        for name in self.steps:
            self.steps[name] += 1
        self.written.update(self.steps)

    def _update(self, c: Chunk, buf: ChunkBuffer, device_grad: torch.Tensor, coef: float, unscale: float) -> None:
        n = c.hi - c.lo
        grad = buf.grad[:n]
        self.copier.to_host(grad, device_grad[c.lo:c.hi])  # fp32 (buf.grad's dtype) on the way
        self.copier.wait_host()
        if device_grad.dtype != torch.float32:  # the engine unscaled fp32 gradients only
            scale_(grad, unscale)
        scale_(grad, coef)
        step = torch.tensor(float(self.steps[c.name]), dtype=torch.float32)  # the step adds one
        master = buf.states["master"][:n]
        self.optimizer.update_piece(master, grad, {k: buf.states[k][:n] for k in self.optimizer_spec.states},
                                    step, self.optimizer.param_groups[c.group_index])
        source = master
        if buf.staging is not None:
            source = buf.staging[:n].copy_(master)
        copy_into_pieces(self.copier, self.specs[c.name], c.lo, source)
        self.copier.wait_host()  # the buffer is reused two chunks later

    # ------------------------------------------------------------ checkpoints and accounting

    @contextlib.contextmanager
    def materialized(self):
        """Inside: the engine's master shards and `optimizer.state` hold the full states as host
        tensors; a group never stepped nor loaded gets the spec's `initial_state` (its files hold nothing
        yet). On exit whatever they then hold (a loaded checkpoint, say) is written back and the memory released."""
        opt = self.optimizer_spec
        for name, master in self.masters.items():
            numel = self.specs[name].numel
            master.data = torch.empty(numel, dtype=torch.float32)
            self.files.read(name, "master", 0, master.data)
            if name in self.written:
                dtypes = file_states(opt, self.state_dtype)
                state = {key: torch.empty(numel, dtype=dtypes[key]) for key in opt.states}
                for key, tensor in state.items():
                    self.files.read(name, key, 0, tensor)
                self.optimizer.state[master] = state
                self.optimizer.set_step_count([master], self.steps[name])
        try:
            yield
        finally:
            self._write_back()

    def _write_back(self) -> None:
        opt = self.optimizer_spec
        for name, master in self.masters.items():
            self.files.write(name, "master", 0, master.data.contiguous())
            state = self.optimizer.state.get(master)
            if state:
                missing = [key for key in opt.states if key not in state]
                if missing:
                    raise KeyError(f"group {name!r}: the {opt.name} optimizer's state lacks {missing}; "
                                   f"it keeps {list(opt.states)}")
                self.steps[name] = self.optimizer.step_count([master])
                dtypes = file_states(opt, self.state_dtype)
                for key in opt.states:
                    self.files.write(name, key, 0, state[key].to(dtypes[key]).contiguous())
                self.written.add(name)
            self.optimizer.state.pop(master, None)
            master.data = torch.empty(0, dtype=torch.float32)

    def after_load(self) -> None:
        """Inside materialized(): the step counts where the host kernels read them; the loaded masters published."""
        self.optimizer.keep_mode()
        for name, master in self.masters.items():
            spec = self.specs[name]
            copy_into_pieces(self.copier, spec, 0, master.data.to(spec.dtype))
        self.copier.wait_host()

    def off_device_bytes(self) -> dict:
        numel = sum(s.numel for s in self.specs.values())
        return {"nvme_master_params": numel * FP32,
                "nvme_optimizer_states": numel * self.optimizer_spec.bytes_per_element(False, self.state_dtype),
                "host_buffers": sum(b.nbytes() for b in self.buffers)}

    def close(self) -> None:
        self.io.shutdown(wait=True)
        self.files.close()
