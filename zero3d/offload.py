"""ZeRO-Offload: fp32 master shards and optimizer states in host memory, the optimizer step on the CPU."""
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from optim import ADAMW, OptimizerSpec
from optim.config import OptimizerConfig
from optim.flat_optimizer import FlatOptimizer, FlatTensor
from zero3d.accounting import nbytes, optimizer_state_bytes
from zero3d.placement import OffDevicePlacement


@dataclass(frozen=True)
class GroupSpec:
    """What the engine hands over for one parameter group."""

    name: str
    master: Optional[torch.Tensor]  # fp32, master coordinates: the initial values (None once copied)
    param_pieces: tuple  # ((offset in master coordinates, compute-dtype device tensor), ...)
    weight_decay: float
    holds_grad: bool = False  # "cpu": the gradient shard lives on the host only (stages 2/3's bucketed groups)
    matrix: bool = False  # a group of whole matrices (the spec's matrix rule updates it)

    @property
    def numel(self) -> int:
        return sum(piece.numel() for _, piece in self.param_pieces)

    @property
    def dtype(self) -> torch.dtype:
        return self.param_pieces[0][1].dtype

    def released(self) -> "GroupSpec":
        """The spec without its initial master, so the device copy is not kept alive."""
        return dataclasses.replace(self, master=None)


def pinned_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor, page-locked when the device is a GPU (so device copies are asynchronous DMA)."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A (page-locked on CUDA) host copy of a device tensor."""
    out = pinned_empty(tensor.numel(), tensor.dtype, tensor.device)
    out.copy_(tensor.view(-1))
    return out.view(tensor.shape)


class Copier:
    """Device <-> host copies. CUDA: non-blocking on a side stream, ordered against the compute
    stream by stream waits; the host waits (`wait_host`) before it reads or reuses a buffer.
    CPU: plain synchronous copies (device and host memory are the same). Counts the bytes each way
    (the PCIe traffic of offload: `offload/` metrics, the probe)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.bytes = {"to_host": 0, "to_device": 0}

    def to_host(self, host: torch.Tensor, src: torch.Tensor) -> None:
        self.bytes["to_host"] += src.numel() * src.element_size()
        if self.stream is None or not src.is_cuda:
            host.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(src.device))  # src is final
        with torch.cuda.stream(self.stream):
            host.copy_(src, non_blocking=True)
        src.record_stream(self.stream)  # not reused by the allocator before the copy ran

    def to_device(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        self.bytes["to_device"] += host.numel() * host.element_size()
        if self.stream is None or not dst.is_cuda:  # also a host destination (stage 3 offload_params)
            dst.copy_(host)
            return
        self.stream.wait_stream(torch.cuda.current_stream(dst.device))  # nobody still reads dst
        with torch.cuda.stream(self.stream):
            dst.copy_(host, non_blocking=True)
        torch.cuda.current_stream(dst.device).wait_stream(self.stream)  # compute sees the new values

    def wait_host(self) -> None:
        """Every copy queued so far has finished (host buffers may be read or rewritten)."""
        if self.stream is not None:
            self.stream.synchronize()


def copy_into_pieces(copier: Copier, spec: GroupSpec, lo: int, source: torch.Tensor) -> None:
    """Elements [lo, lo + len(source)) of the group (master coordinates) into its device pieces."""
    hi = lo + source.numel()
    for offset, piece in spec.param_pieces:
        a, b = max(lo, offset), min(hi, offset + piece.numel())
        if a < b:
            copier.to_device(piece[a - offset:b - offset], source[a - lo:b - lo])


def scale_(tensor: torch.Tensor, factor: float) -> None:
    if factor != 1.0:
        tensor.mul_(factor)


@dataclass
class HostGroup:
    """One group's host-side tensors."""

    spec: GroupSpec
    master: torch.Tensor  # fp32
    grad: torch.Tensor  # fp32: this step's gradient shard (held: accumulated here over micro-batches)
    staging: Optional[torch.Tensor] = None  # compute dtype: gradient pieces landing, then the new parameters


class HostOffload(OffDevicePlacement):
    """offload_optimizer = "cpu": every state in host memory; `optimizer` is the spec's host optimizer
    over the host masters, so `optimizer.state` and the masters are ordinary tensors (checkpoints).

    Groups whose spec `holds_grad` (stages 2/3: gradients reduced bucket by bucket) keep their
    gradient shard only here, as ZeRO-Offload does: each reduced bucket piece is copied down
    (`accumulate_grad`) and added on the host, and the engine reads `grad(name)` as the group's
    gradients (unscale, norm, clip). The others (stage 1, stage 3's persistent groups) keep theirs
    on the device; the step copies them down."""

    name = "cpu"

    def __init__(self, specs: list, config: OptimizerConfig, copier: Copier, optimizer_spec: OptimizerSpec = ADAMW,
                 orthogonalize=None):
        self.device = copier.device
        self.copier = copier
        self.optimizer_spec = optimizer_spec
        self.groups = {spec.name: self._host_group(spec) for spec in specs}
        self.optimizer = FlatOptimizer([FlatTensor(g.master, g.spec.weight_decay, name, 0, g.spec.matrix)
                                        for name, g in self.groups.items()], optimizer_spec, config, fused=True,
                                       orthogonalize=orthogonalize)
        self._landing = []  # (group, lo, hi, alpha): pieces copied down, not yet added into the shard

    def _host_group(self, spec: GroupSpec) -> HostGroup:
        n = spec.numel
        group = HostGroup(spec.released(), master=pinned_empty(n, torch.float32, self.device),
                          grad=pinned_empty(n, torch.float32, self.device).zero_())
        if spec.dtype != torch.float32 or spec.holds_grad:
            group.staging = pinned_empty(n, spec.dtype, self.device)
        self.copier.to_host(group.master, spec.master)
        self.copier.wait_host()
        return group

    def master(self, name: str) -> torch.Tensor:
        return self.groups[name].master

    def grad(self, name: str) -> torch.Tensor:
        """The host fp32 gradient shard of a group whose spec holds its gradients."""
        return self.groups[name].grad

    # ------------------------------------------------------------ gradients

    def accumulate_grad(self, group, lo: int, piece: torch.Tensor, alpha: float) -> None:
        """A reduced bucket piece for shard elements [lo, lo + n) of the engine's `group`. Held groups:
        copied down now (on CUDA behind the reduction, on the side stream) and added, times `alpha`,
        into the host shard once it landed. The pieces already in flight are added first, so a later
        micro-batch's copy of the same range never overwrites one not yet added; the add thus trails
        the copy by one bucket. Other groups keep their gradients on the device."""
        host = self.groups[group.name]
        if not host.spec.holds_grad:
            super().accumulate_grad(group, lo, piece, alpha)
            return
        self.finish_grads()
        hi = lo + piece.numel()
        self.copier.to_host(host.staging[lo:hi], piece)
        self._landing.append((host, lo, hi, alpha))

    def finish_grads(self) -> None:
        """Every piece copied down is added into its host shard (the engine calls it before the step)."""
        if not self._landing:
            return
        self.copier.wait_host()
        for group, lo, hi, alpha in self._landing:
            group.grad[lo:hi].add_(group.staging[lo:hi], alpha=alpha)
        self._landing = []

    def master_grad(self, name: str, pieces: list) -> torch.Tensor:
        """The host fp32 gradient shard: held groups' is the engine's own; the others' device pieces are copied down
        into it (cast on the way, a piece at a time), so no fp32 copy of the shard is made on the device."""
        group = self.groups[name]
        if group.spec.holds_grad:
            return super().master_grad(name, pieces)
        lo = 0
        for piece in pieces:
            self.copier.to_host(group.grad[lo:lo + piece.numel()], piece)
            lo += piece.numel()
        self.copier.wait_host()
        return group.grad

    # ------------------------------------------------------------ step

    def step(self, master_grads: dict, coef: float, lr: float, unscale: float = 1.0) -> None:
        """The engine's unscaled gradients (the host shards `master_grad` gave; any other tensor is copied down into
        them), clipped, the optimizer step on the CPU, updated parameters into the device pieces in the compute
        dtype."""
        for name, group in self.groups.items():
            if master_grads.get(name, group.grad) is not group.grad:
                self.copier.to_host(group.grad, master_grads[name])
        self.copier.wait_host()
        for group in self.groups.values():
            scale_(group.grad, coef)
            group.master.grad = group.grad
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        self.optimizer.step()
        for group in self.groups.values():
            group.master.grad = None
        self.publish()

    def publish(self) -> None:
        """Every host master into its device pieces, cast to the compute dtype on the host."""
        for group in self.groups.values():
            source = group.master
            if group.spec.dtype != torch.float32:
                source = group.staging.copy_(group.master)
            copy_into_pieces(self.copier, group.spec, 0, source)
        self.copier.wait_host()

    def zero_grad(self) -> None:
        """Nothing to clear: held shards are the engine's (it zeroes them); `master_grad` overwrites the others."""
        self.finish_grads()  # pieces of a skipped step may still be landing

    # ------------------------------------------------------------ checkpoints and accounting

    def after_load(self) -> None:
        self.optimizer.keep_mode()
        self.publish()

    def off_device_bytes(self) -> dict:
        return {"host_master_params": sum(nbytes(g.master) for g in self.groups.values()),
                "host_optimizer_states": optimizer_state_bytes(self.optimizer),
                "host_grads": sum(nbytes(g.grad) + nbytes(g.staging) for g in self.groups.values())}

    def host_tensors(self) -> dict:
        groups = self.groups.values()
        states = [t for state in self.optimizer.state.values() for t in state.values()
                  if torch.is_tensor(t) and t.dim()]
        return {"optimizer": [g.master for g in groups] + states, "grads": [g.grad for g in groups],
                "temporaries": [g.staging for g in groups if g.staging is not None]}

    def held_grad_bytes(self) -> int:
        """Bytes of the gradient shards kept only here (the stage counts them as its `grads`)."""
        return sum(nbytes(g.grad) for g in self.groups.values() if g.spec.holds_grad)
