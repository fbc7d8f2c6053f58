"""The data-parallel interface the training loop uses; each ZeRO stage is one small subclass."""
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from zero3d.comm import Comm, CommStats
from zero3d.flat import FlatLayout, param_groups
from zero3d.optim import make_optimizer
from zero3d.precision import LossScaler, NoScaler


@dataclass
class EngineSettings:
    """What the engine needs from the config (plain values, so zero3d stays model-agnostic)."""

    bucket_elements: int = 50_000_000
    overlap_comm: bool = True
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 0.0
    dtype: torch.dtype = torch.float32
    loss_scaler: Optional[LossScaler] = None  # fp16 only
    param_persistence_threshold: int = 0  # stage 3
    prefetch_units: int = 1  # stage 3


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
    master: Optional[torch.Tensor] = None  # fp32 tensor the optimizer updates
    buckets: tuple = ()  # CB: communication units over the flat buffer
    norm_ranges: tuple = ()  # (lo, hi) in master coordinates that count toward the norm


class DataParallelEngine:
    """Template: backward() → step(lr) → [grads reduced, unscaled, clipped, optimizer, params published].

    Subclasses fill in what is stored and communicated: `_build_group`, `_reduce_grads`,
    `_master_grad`, `_publish_params`, `zero_grad`, `state_bytes`.
    """

    stage: int = -1

    def __init__(self, model: nn.Module, settings: EngineSettings, groups: ParallelGroups):
        self.model = model
        self.settings = settings
        self.comm_stats = CommStats()
        self.dp = Comm(groups.dp_group, self.comm_stats)
        self.world = Comm(groups.world_group, self.comm_stats)
        self.tp_rank = groups.tp_rank
        self.tied = {p: Comm(group, self.comm_stats) for p, group in groups.tied.items()}
        self._norm_excluded = {n for n, p in model.named_parameters() if p in groups.norm_excluded}
        self.device = next(model.parameters()).device
        self.scaler = settings.loss_scaler or NoScaler()
        self.groups = self._build_groups(param_groups(model))
        self.optimizer = make_optimizer(
            [(g.master, settings.weight_decay if is_decay_group(name) else 0.0)
             for name, g in self.groups.items()],
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
        """Reduce, unscale, norm, clip, update, publish; every rank takes the same decision."""
        self._sum_tied_grads()
        self._reduce_grads()
        master_grads = {name: self._master_grad(g) for name, g in self.groups.items()}
        if self.scaler.scale != 1.0:
            for grad in master_grads.values():
                grad.mul_(1.0 / self.scaler.scale)
        norm = self._global_grad_norm(master_grads)
        # The norm is all-reduced over every rank, so an inf/nan anywhere is seen everywhere.
        overflow = not math.isfinite(norm)
        self.scaler.update(overflow)
        if not overflow:
            coef = 1.0
            if self.settings.clip_grad > 0:
                coef = min(1.0, self.settings.clip_grad / (norm + 1e-6))
            for name, g in self.groups.items():
                if coef < 1.0:
                    master_grads[name].mul_(coef)
                g.master.grad = master_grads[name]
            for pg in self.optimizer.param_groups:
                pg["lr"] = lr
            self.optimizer.step()
            for g in self.groups.values():
                g.master.grad = None
            self._publish_params()
        self.zero_grad()
        return StepResult(grad_norm=norm, skipped=overflow, loss_scale=self.scaler.scale)

    def train(self):
        self.model.train()

    def eval(self):
        self.model.eval()

    # ------------------------------------------------------------ shared pieces

    def _sum_tied_grads(self) -> None:
        """Stages keeping whole gradients (0, 1) sum tied ones over their group once per step;
        stage 2 sums each micro-batch's before it is bucketed (finish_backward)."""
        for p, comm in self.tied.items():
            comm.all_reduce(p.grad, tag="tied_grads")

    def _norm_ranges(self, layout: FlatLayout, offset: int) -> tuple:
        """Ranges of this rank's shard to count: TP-duplicated parameters count on TP rank 0 only."""
        return tuple((offset + lo, offset + hi) for slot, lo, hi in layout.slots_in_shard(self.dp.rank)
                     if (slot.tp_partitioned or self.tp_rank == 0) and slot.name not in self._norm_excluded)

    def _global_grad_norm(self, master_grads: dict) -> float:
        local = torch.zeros(1, dtype=torch.float64, device=self.device)
        for name, g in self.groups.items():
            grad = master_grads[name]
            for lo, hi in g.norm_ranges:
                local += grad[lo:hi].double().pow(2).sum()
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
        for g in self.groups.values():
            # Storage identity, not data_ptr(): fake tensors (the rank-local probe) all report 0.
            if g.param_flat is None or g.master.untyped_storage() is not g.param_flat.untyped_storage():
                total += g.master.numel() * g.master.element_size()
        return total

    def state_bytes(self) -> dict:
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"stage": self.stage, "optimizer": self.optimizer.state_dict(),
                "master": {n: g.master for n, g in self.groups.items()},
                "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["stage"] != self.stage:
            raise ValueError(f"checkpoint was written by ZeRO stage {state['stage']}, this run uses "
                             f"stage {self.stage}; resume with zero.stage = {state['stage']}")
        for name, g in self.groups.items():
            saved = state["master"][name]
            if saved.shape != g.master.shape:
                raise ValueError(f"checkpoint master shard for group {name!r} has shape "
                                 f"{tuple(saved.shape)}, this layout needs {tuple(g.master.shape)}: "
                                 "resume with the same model, data- and tensor-parallel sizes")
            g.master.data.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])
        self._publish_params()

    # ------------------------------------------------------------ stage hooks

    def _build_groups(self, named_groups: dict) -> dict:
        """{name: GroupState}; stages 0-2 keep one group per decay class ("decay", "no_decay")."""
        return {name: self._build_group(name, named) for name, named in named_groups.items()}

    def _build_group(self, name: str, named_params: list) -> GroupState:
        raise NotImplementedError

    def _reduce_grads(self) -> None:
        raise NotImplementedError

    def _master_grad(self, g: GroupState) -> torch.Tensor:
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
    rank-local probe (pretrain/probe.py) runs the engine on fake tensors, which hold no values, and
    answers this read with a fixed finite number instead."""
    return value.item()


def wait_all(handles: list) -> None:
    for h in handles:
        if h is not None:
            h.wait()
    handles.clear()


def is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"
