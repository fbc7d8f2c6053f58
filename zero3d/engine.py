"""The data-parallel interface the training loop uses; each ZeRO stage is one small subclass."""
import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn

from zero3d.comm import Comm, CommStats
from zero3d.config import ZeroConfig
from zero3d.flat import FlatLayout, param_groups
from zero3d.nvme import NvmeOffload
from zero3d.offload import Copier, GroupSpec, HostOffload, device_state_bytes
from zero3d.optim import make_optimizer
from zero3d.precision import LossScaleConfig, make_scaler


@dataclass
class EngineSettings:
    """What the engine needs from the config (plain values, so zero3d stays model-agnostic)."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 0.0
    dtype: torch.dtype = torch.float32
    loss_scale: Optional[LossScaleConfig] = None  # fp16 only: the engine builds its scaler from it
    # Stage 3: model -> [(name, module)] gathered as units (pretrain passes megatron's layers);
    # None: the model's top-level children.
    units: Optional[Callable[[nn.Module], list]] = None


@dataclass
class ParallelGroups:
    """The process groups the engine talks over (torch.distributed groups; None = WORLD)."""

    dp_group: object
    tp_rank: int = 0
    world_group: object = None  # every rank that holds a piece of the gradient norm (DP × TP × PP)
    # Weights whose gradient is split over other ranks — tied embeddings across pipeline stages,
    # megatron's sequence-parallel layer norms across the TP group: param -> that group; the
    # gradient is summed over it (once per step) before the DP reduction.
    tied: dict = field(default_factory=dict)
    norm_excluded: frozenset = frozenset()  # copies whose twin already counts in the norm


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    loss_scale: float


@dataclass
class GroupState:
    """One parameter group (decay / no_decay): its layout and the tensors a stage keeps for it."""

    name: str
    layout: FlatLayout
    params: list
    param_flat: Optional[torch.Tensor] = None  # model dtype: full (stages 0-2) or shard (stage 3)
    grads: Optional[torch.Tensor] = None  # model dtype: full buffer (stages 0-1) or shard (2-3)
    # fp32 tensors the optimizer updates, as (offset in master coordinates, tensor): one contiguous
    # tensor, or — fp32 stages 1/2, whose shard is one piece per bucket of the parameter buffer —
    # views of those pieces, so the parameters stay the master copy.
    master_pieces: tuple = ()
    norm_ranges: tuple = ()  # (lo, hi) in master coordinates that count toward the norm

    @property
    def buckets(self) -> list:
        return self.layout.buckets

    def master(self) -> torch.Tensor:
        """The fp32 master in master coordinates (a copy when it lives in pieces)."""
        if len(self.master_pieces) == 1:
            return self.master_pieces[0][1]
        return torch.cat([piece for _, piece in self.master_pieces])


class DataParallelEngine:
    """Template: backward() → step(lr) → [grads reduced, unscaled, clipped, optimizer, params published].

    Subclasses fill in what is stored and communicated: `_build_group`, `_reduce_grads`,
    `_master_grad`, `_publish_params`, `zero_grad`, `_state_bytes`.
    """

    stage: int = -1

    def __init__(self, model: nn.Module, settings: EngineSettings, groups: ParallelGroups):
        self.model = model
        self.settings = settings
        self.comm_stats = CommStats()
        self.dp = Comm(groups.dp_group, self.comm_stats)
        self.world = Comm(groups.world_group, self.comm_stats)
        self.tp_rank = groups.tp_rank
        self.tied = {param: Comm(group, self.comm_stats) for param, group in groups.tied.items()}
        self._norm_excluded = {n for n, p in model.named_parameters() if p in groups.norm_excluded}
        self.device = next(model.parameters()).device
        self.scaler = make_scaler(settings.loss_scale)
        # Gradients are multiplied by pre_scale before the DP sum and by post_scale after it.
        predivide = settings.zero.predivide(self.dp.size)
        self.pre_scale, self.post_scale = 1.0 / predivide, predivide / self.dp.size
        self.pending_param_gathers: dict = {}  # stages 1/2: (group name, bucket index) -> collective
        self.copier = Copier(self.device)  # device <-> host copies of offloaded states (counts their bytes)
        self.groups = self._build_groups(param_groups(model))
        self.offload = None  # ZeRO-Offload: HostOffload / NvmeOffload when the master and Adam states are off the device
        self.host_grad_groups: frozenset = frozenset()  # groups whose gradient shard lives on the host only
        if settings.zero.offload_optimizer != "none":
            self.optimizer = self._offload_optimizer()
        else:
            self.optimizer = make_optimizer(
                [(piece, self._weight_decay(name)) for name, group in self.groups.items()
                 for _, piece in group.master_pieces],
                lr=settings.lr, betas=settings.betas, eps=settings.eps)

    # ------------------------------------------------------------ loop-facing interface

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    __call__ = forward

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch; `loss` is already divided by the accumulation steps."""
        self.scale_loss(loss).backward()
        self.finish_backward()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """fp16: the loss times the dynamic scale (a pipeline schedule calls this itself)."""
        return loss * self.scaler.scale

    def finish_backward(self) -> None:
        """After each micro-batch's backward (a pipeline schedule: after the step's last one)."""

    def step(self, lr: float) -> StepResult:
        """Reduce, unscale, norm, clip, update, publish; every rank takes the same decision.

        The overflow rule, the same for every stage: the step is skipped when the global norm of
        the reduced, unscaled gradients is not finite (an inf/nan in any rank's gradients reaches
        that norm through the reduction or through the norm's all-reduce).
        """
        self.finish_param_sync()
        self._reduce_grads()
        if self.offload is not None:
            self.offload.finish_grads()  # the last gradient pieces copied to the host are added there
        master_grads = {name: self._master_grad(group) for name, group in self.groups.items()}
        if self.scaler.scale != 1.0:
            for grad in master_grads.values():
                grad.mul_(1.0 / self.scaler.scale)
        norm = self._global_grad_norm(master_grads)
        overflow = not math.isfinite(norm)
        self.scaler.update(overflow)
        if not overflow:
            self._apply_update(master_grads, norm, lr)
            self._publish_params()
        self.zero_grad()
        if self.offload is not None:
            self.offload.zero_grad()
        return StepResult(grad_norm=norm, skipped=overflow, loss_scale=self.scaler.scale)

    def finish_param_sync(self) -> None:
        """Wait for parameter all-gathers still in flight (stages 1/2 overlap them with the next
        forward); call before reading parameters outside a forward."""
        for key in list(self.pending_param_gathers):
            self.pending_param_gathers.pop(key).wait()

    def train(self):
        self.model.train()

    def eval(self):
        self.model.eval()

    # ------------------------------------------------------------ shared pieces

    def _apply_update(self, master_grads: dict, norm: float, lr: float) -> None:
        coef = 1.0
        if self.settings.clip_grad > 0:
            coef = min(1.0, self.settings.clip_grad / (norm + 1e-6))
        if self.offload is not None:  # clip, AdamW on the host; the parameters come back in the compute dtype
            self.offload.step(master_grads, coef, lr)
            return
        for name, group in self.groups.items():
            grad = master_grads[name]
            if coef < 1.0:
                grad.mul_(coef)
            for offset, piece in group.master_pieces:
                piece.grad = grad[offset:offset + piece.numel()]
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        self.optimizer.step()
        for group in self.groups.values():
            for _, piece in group.master_pieces:
                piece.grad = None

    def _weight_decay(self, name: str) -> float:
        return self.settings.weight_decay if is_decay_group(name) else 0.0

    # ------------------------------------------------------------ ZeRO-Offload (zero3d/offload.py, nvme.py)

    def _offload_optimizer(self):
        """The master and Adam states of every group move off the device; each group's master
        becomes the host tensor (NVMe: an empty placeholder outside `materialized_states()`)."""
        zero, s = self.settings.zero, self.settings
        on_host = zero.offload_optimizer == "cpu"  # NVMe keeps host memory bounded: its gradients stay
        specs = [GroupSpec(name, group.master(), self._param_pieces(group), self._weight_decay(name),
                           holds_grad=on_host and self._grads_reduced_in_buckets(name))
                 for name, group in self.groups.items()]
        if on_host:
            self.offload = HostOffload(specs, s.lr, s.betas, s.eps, self.copier)
        else:
            self.offload = NvmeOffload(specs, s.lr, s.betas, s.eps, self.copier, zero.nvme_path,
                                       zero.nvme_buffer_bytes, self.world.rank)
        for spec in specs:
            group = self.groups[spec.name]
            group.master_pieces = ((0, self.offload.master(spec.name)),)
            if spec.holds_grad:  # the device gradient shard is freed: the host one replaces it
                group.grads = self.offload.grad(spec.name)
        self.host_grad_groups = frozenset(spec.name for spec in specs if spec.holds_grad)
        return self.offload.optimizer

    def _grads_reduced_in_buckets(self, name: str) -> bool:
        """Whether the group's gradients arrive as reduced bucket pieces during backward (stages 2/3)."""
        return False

    def _param_pieces(self, group: GroupState) -> tuple:
        """The model-dtype parameter elements matching the group's master coordinates, as
        ((offset, tensor), ...): the whole tensor when the master covers it, else this rank's pieces."""
        master_numel = sum(piece.numel() for _, piece in group.master_pieces)
        if master_numel == group.param_flat.numel():
            return ((0, group.param_flat),)
        return tuple((bucket.shard_start, group.param_flat[lo:hi]) for bucket, lo, hi in group.layout.pieces(self.dp.rank))

    def accumulate_grad_piece(self, group: GroupState, lo: int, piece: torch.Tensor) -> None:
        """Stages 2/3 (zero3d/buckets.py): a reduced bucket piece for shard elements [lo, lo + n),
        added (× post-scale) into the gradient shard, or, when that lives on the host, copied there
        now (overlapping the rest of backward) and added on arrival."""
        if group.name in self.host_grad_groups:
            self.offload.accumulate_grad(group.name, lo, piece, self.post_scale)
        else:
            group.grads[lo:lo + piece.numel()].add_(piece, alpha=self.post_scale)

    def materialized_states(self):
        """Context: inside it every master and `optimizer.state` is a tensor (NVMe: read from the
        files, written back on exit). Checkpoint code reads and writes them only inside it."""
        return self.offload.materialized() if self.offload is not None else contextlib.nullcontext()

    def masters_loaded(self) -> None:
        """After the masters (and Adam states) were overwritten, e.g. by a checkpoint load: the
        model-dtype parameters follow. NVMe: call inside `materialized_states()`."""
        if self.offload is not None:
            self.offload.after_load()  # host masters into the device parameter pieces
        self._publish_params()

    def close(self) -> None:
        """Releases the offload's files and I/O thread (also done when the process ends)."""
        if self.offload is not None:
            self.offload.close()

    def _sum_tied_grads(self) -> None:
        """Stages keeping whole gradients (0, 1) sum tied ones over their group once per step;
        stage 2 sums each micro-batch's before it is bucketed (finish_backward)."""
        for param, comm in self.tied.items():
            comm.all_reduce(param.grad, tag="tied_grads")

    def _norm_ranges(self, layout: FlatLayout, flat: bool) -> tuple:
        """Ranges of this rank's shard to count (in flat coordinates when the master is the whole
        buffer, else in shard coordinates): TP-duplicated parameters count on TP rank 0 only."""
        return tuple((flat_lo, flat_hi) if flat else (shard_lo, shard_lo + flat_hi - flat_lo)
                     for slot, flat_lo, flat_hi, shard_lo in layout.owned_slot_ranges(self.dp.rank)
                     if (slot.tp_partitioned or self.tp_rank == 0) and slot.name not in self._norm_excluded)

    def _global_grad_norm(self, master_grads: dict) -> float:
        local = torch.zeros(1, dtype=torch.float64, device=self.device)
        for name, group in self.groups.items():
            grad = master_grads[name]
            for lo, hi in group.norm_ranges:  # (on the host for gradient shards held there)
                local += grad[lo:hi].double().pow(2).sum().to(local.device)
        self.world.all_reduce(local, tag="grad_norm")
        total = read_host_float(local)
        return math.sqrt(total) if math.isfinite(total) else float("inf")

    def _as_fp32(self, grad: torch.Tensor) -> torch.Tensor:
        """The optimizer works in fp32: a view when grads already are, else a temporary copy."""
        return grad if grad.dtype == torch.float32 else grad.float()

    def optimizer_state_bytes(self) -> int:
        """Bytes of the optimizer's per-element states (Adam's two moments); scalar step counters excluded."""
        total = 0
        for state in self.optimizer.state.values():
            for value in state.values():
                if torch.is_tensor(value) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total

    def _master_bytes(self) -> int:
        """fp32 master bytes that are not shared with the model's own parameter storage."""
        total = 0
        for group in self.groups.values():
            for _, piece in group.master_pieces:
                # Storage identity, not data_ptr(): fake tensors (the rank-local probe) all report 0.
                if group.param_flat is None or piece.untyped_storage() is not group.param_flat.untyped_storage():
                    total += piece.numel() * piece.element_size()
        return total

    def state_bytes(self) -> dict:
        """Model-state bytes per category on the device; with offload also host_* / nvme_* keys."""
        out = self._state_bytes()
        placement = self.settings.zero.offload_params
        if placement != "none":  # stage 3's parameter shards live on the host or in files
            out[("host_" if placement == "cpu" else "nvme_") + "params"], out["params"] = out["params"], 0
        return device_state_bytes(out, self.offload) if self.offload is not None else out

    def _state_bytes(self) -> dict:
        raise NotImplementedError

    def state_dict(self) -> dict:
        self.finish_param_sync()
        with self.materialized_states():  # detached copies outlive an NVMe read-in
            return {"stage": self.stage, "optimizer": self.optimizer.state_dict(),
                    "master": {name: group.master().detach().clone() for name, group in self.groups.items()},
                    "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["stage"] != self.stage:
            raise ValueError(f"checkpoint was written by ZeRO stage {state['stage']}, this run uses "
                             f"stage {self.stage}; resume with zero.stage = {state['stage']}")
        with self.materialized_states():  # NVMe: written back to the files on exit
            for name, group in self.groups.items():
                saved = state["master"][name]
                size = sum(piece.numel() for _, piece in group.master_pieces)
                if tuple(saved.shape) != (size,):
                    raise ValueError(f"checkpoint master shard for group {name!r} has shape "
                                     f"{tuple(saved.shape)}, this layout needs {(size,)}: "
                                     "resume with the same model, data- and tensor-parallel sizes")
                for offset, piece in group.master_pieces:
                    piece.data.copy_(saved[offset:offset + piece.numel()])
            self.optimizer.load_state_dict(state["optimizer"])
            self.masters_loaded()
        self.scaler.load_state_dict(state["scaler"])
        self.finish_param_sync()

    # ------------------------------------------------------------ stage hooks

    def _build_groups(self, named_groups: dict) -> dict:
        """{name: GroupState}; stages 0-2 keep one group per decay class ("decay", "no_decay")."""
        return {name: self._build_group(name, named) for name, named in named_groups.items()}

    def _layout(self, named_params: list) -> FlatLayout:
        return FlatLayout(named_params, self.dp.size, self.settings.zero.bucket_elements)

    def _build_group(self, name: str, named_params: list) -> GroupState:
        raise NotImplementedError

    def _reduce_grads(self) -> None:
        raise NotImplementedError

    def _master_grad(self, group: GroupState) -> torch.Tensor:
        raise NotImplementedError

    def _publish_params(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError


def is_decay_group(name: str) -> bool:
    """Weight decay applies to groups named "decay" or "<anything>/decay" (stage 3: "<unit>/decay")."""
    return name.rsplit("/", 1)[-1] == "decay"


def read_host_float(value: torch.Tensor) -> float:
    """The engine's one device-to-host read (the all-reduced squared gradient norm). A seam: the
    rank-local probe (pretrain/probe/cli.py) runs the engine on fake tensors, which hold no values, and
    answers this read with a fixed finite number instead."""
    return value.item()


__all__ = ["DataParallelEngine", "EngineSettings", "GroupState", "ParallelGroups", "StepResult", "is_decay_group",
           "read_host_float"]
