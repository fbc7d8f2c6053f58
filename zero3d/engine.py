"""The data-parallel interface the training loop uses; each ZeRO stage is one small subclass."""
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn

from optim import OptimizerSpec, spec_named
from optim.config import OptimizerConfig
from optim.flat_optimizer import FlatOptimizer, FlatTensor
from zero3d.accounting import model_state_bytes
from zero3d.comm.core import Comm, CommStats, wait_all
from zero3d.comm.plan import CommPlan
from zero3d.comm.topology import NodeTopology
from zero3d.config import LossScaleConfig, ZeroConfig
from zero3d.flat import FlatLayout, flatten_grads, flatten_params, group_kind, param_groups
from zero3d.nvme import NvmeOffload
from zero3d.offload import Copier, GroupSpec, HostOffload
from zero3d.placement import DevicePlacement, Placement
from zero3d.precision import make_scaler
from zero3d.whole_matrix import whole_matrix_step


def read_host_floats(values: torch.Tensor) -> list[float]:
    """The engine's one device-to-host read per step: the all-reduced vector [squared gradient norm,
    the caller's step sums...] (see `DataParallelEngine.step`); the default of `EngineSettings.read_host_floats`."""
    return values.tolist()


NORM_BLOCK = 1 << 22  # the most elements whose squares one norm sums in fp32; those sums are added in fp64


def sum_of_squares(pieces: list, unscale: float = 1.0) -> torch.Tensor:
    """Σ x² over 1-D tensors of one dtype, a 0-d fp64 tensor: each piece's blocks of NORM_BLOCK elements (counted from
    the piece's start, so a shard's pieces give the same sums whatever coordinates they are cut from) 2-normed in fp32
    by one multi-tensor kernel, in one read and no copy of the gradients (relative error ~1e-7; a `.double()` copy
    squared and summed in fp64 moves three times the bytes in three kernels a piece: on a GPU it was the step's largest
    cost beyond the model); the blocks' squares added in fp64. A block norm past 1.8e19 is inf: an overflow, skipped.
    Pieces in a compute dtype (the gradients a mixed-precision step reads so) are read as they are, the kernel upcasting
    each element (the norms of their fp32 copies, to the bit, without the copy: 2 bytes an element read where the copy
    moved 10); `unscale`, the factor they still need, multiplies their norms in fp64 (‖u·x‖ = |u|·‖x‖: to the bit for
    a power-of-two loss scale, as dynamic loss scaling keeps it)."""
    blocks = [piece[lo:lo + NORM_BLOCK] for piece in pieces for lo in range(0, piece.numel(), NORM_BLOCK)]
    if not blocks:
        return torch.zeros((), dtype=torch.float64)
    dtypes = {block.dtype for block in blocks}
    if len(dtypes) > 1:
        raise ValueError(f"sum_of_squares takes pieces of one dtype (a group's gradient), got {sorted(map(str, dtypes))}")
    norms = torch.stack(torch._foreach_norm(blocks, 2, dtype=torch.float32)).double()
    if unscale != 1.0 and blocks[0].dtype != torch.float32:
        norms = norms * abs(unscale)
    return norms.square().sum()


@dataclass
class EngineSettings:
    """What the engine needs (zero3d's own sections and plain values, so zero3d stays model-agnostic)."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    dtype: torch.dtype = torch.float32
    loss_scale: Optional[LossScaleConfig] = None  # fp16 only: the engine builds its scaler from it
    # Stage 3: model -> [(name, module)] gathered as units (pretrain passes megatron's layers);
    # None: the model's top-level children.
    units: Optional[Callable[[nn.Module], list]] = None
    # The optimizer: its states, its update, the parameters it takes whole (optim/); the checkpoint and the
    # accounting ask it too. None: the spec of `optimizer.name`.
    optimizer_spec: Optional[OptimizerSpec] = None
    # Seams for the rank-local probe (pretrain/probe/rank.py), which runs the engine on fake tensors
    # standing in for a GPU: whether the device optimizer runs its fused kernels (None: on CUDA; True: also
    # elsewhere, as a GPU would), and the one device-to-host read per step (fake tensors hold no values):
    # float64 vector -> its values as floats.
    fused_optimizer: Optional[bool] = None
    read_host_floats: Callable[[torch.Tensor], list] = read_host_floats

    def __post_init__(self):
        if self.optimizer_spec is None:
            self.optimizer_spec = spec_named(self.optimizer.name)


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
    # megatron's tensor-parallel group: an optimizer taking matrices whole (Muon) joins their TP shards over it.
    tp_group: object = None
    norm_excluded: frozenset = frozenset()  # copies whose twin already counts in the norm
    # zero3d/comm/topology.py's NodeTopology of the DP group (with its intra-/inter-node sub-groups): needed
    # by the node-aware modes (ZeroConfig.node_aware()); its gpus_per_node also splits the bytes per link.
    node_topology: Optional[NodeTopology] = None
    # Without a node topology: global rank g is on node g // gpus_per_node, only to count every DP
    # collective's bytes per link (comm/intra_node_bytes, comm/inter_node_bytes); None: not split.
    gpus_per_node: Optional[int] = None


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool
    loss_scale: float
    sums: tuple = ()  # `step(lr, sums=...)`: each value summed over every rank of the world group


@dataclass
class GroupState:
    """One parameter group: its layout and the tensors a stage keeps for it."""

    name: str
    layout: FlatLayout
    params: list
    decays: bool  # weight decay applies (matrices; not biases or norms)
    matrix: bool = False  # the optimizer takes its parameters whole (its spec's matrix rule: Muon's hidden matrices)
    # Its gradients arrive as reduced bucket pieces during backward (stage 2, stage 3's sharded groups).
    bucketed: bool = False
    param_flat: Optional[torch.Tensor] = None  # model dtype: full (stages 0-2) or shard (stage 3)
    grads: Optional[torch.Tensor] = None  # model dtype: full buffer (stages 0-1) or shard (2-3)
    # The shard on the device (stages 2/3) exists from the step's first reduced piece to the end of the step: `grads`
    # is None between steps, so the forward of a step's first micro-batch does not hold it.
    grads_per_step: bool = False
    # fp32 tensors the optimizer updates, as (offset in master coordinates, tensor): one contiguous
    # tensor, or — fp32 stages 1/2, whose shard is one piece per bucket of the parameter buffer —
    # views of those pieces, so the parameters stay the master copy.
    master_pieces: tuple = ()
    norm_ranges: tuple = ()  # (lo, hi) in master coordinates that count toward the norm
    secondary: Optional[torch.Tensor] = None  # stage 3 hpZ: this rank's node-local slice of the parameters

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
    `_publish_params`; `_master_grad`, `zero_grad` and `_state_bytes` have defaults (whole gradient
    tensors, counted by zero3d/accounting.py). The update runs wherever `placement` keeps the masters.
    """

    stage: int = -1

    def __init__(self, model: nn.Module, settings: EngineSettings, groups: ParallelGroups):
        self.model = model
        self.settings = settings
        self.hooks: list = []  # handles of the hooks the engine put on the model and its parameters (close())
        self.comm_stats = CommStats()
        # Every DP collective as the ZeRO modes have it (zero3d/comm/plan.py); `dp`: the group states are
        # sharded over (hybrid: the node), the one the stages use.
        self.plan = CommPlan(settings.zero.comm_modes(), groups.dp_group, self.comm_stats, groups.node_topology,
                             groups.gpus_per_node, settings.zero.quant_block, settings.zero.fp8_gather)
        self.dp = self.plan.shard
        dp_size = self.plan.dp_size  # gradients are averaged over every DP rank, whatever shards them
        self.world = Comm(groups.world_group, self.comm_stats)
        self.tp_rank = groups.tp_rank
        self.tp = Comm(groups.tp_group, self.comm_stats) if groups.tp_group is not None else None
        self.tied = {param: Comm(group, self.comm_stats) for param, group in groups.tied.items()}
        self._norm_excluded = {n for n, p in model.named_parameters() if p in groups.norm_excluded}
        self.device = next(model.parameters()).device
        self.scaler = make_scaler(settings.loss_scale)
        # Gradients are multiplied by pre_scale before the DP sum and by post_scale after it.
        predivide = settings.zero.predivide(dp_size)
        self.pre_scale, self.post_scale = 1.0 / predivide, predivide / dp_size
        self.pending_param_gathers: dict = {}  # stages 1/2: (group name, bucket index) -> collective
        self.copier = Copier(self.device)  # device <-> host copies of offloaded states (counts their bytes)
        takes_whole = settings.optimizer_spec.takes_whole if settings.optimizer_spec.matrix else None
        self.groups = self._build_groups(param_groups(model, settings.optimizer.no_decay_patterns, takes_whole))
        self.placement = self._build_placement()  # where the masters and Adam states live
        self.optimizer = self.placement.optimizer

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

    def step(self, lr: float, sums: Optional[torch.Tensor] = None) -> StepResult:
        """Reduce, unscale, norm, clip, update, publish; every rank takes the same decision.

        The overflow rule, the same for every stage: the step is skipped when the global norm of
        the reduced, unscaled gradients is not finite (an inf/nan in any rank's gradients reaches
        that norm through the reduction or through the norm's all-reduce).

        `sums`: this rank's values (e.g. the training loop's loss sum) to sum over the world group in
        the norm's all-reduce, read back with it in the step's one host read: `StepResult.sums`, in fp64,
        whether or not the step is skipped. Every rank passes the same number of values (or None on all).
        """
        self.finish_param_sync()
        for group in self.groups.values():  # a step without a backward steps on zero gradients
            self.grad_shard(group)
        self._reduce_grads()
        self.placement.finish_grads()  # e.g. the last gradient pieces copied to the host are added there
        master_grads = {name: self._master_grad(group) for name, group in self.groups.items()}
        unscale = 1.0 / self.scaler.scale  # fp32 gradients unscaled here; those kept in the compute dtype, where read
        if unscale != 1.0:
            for grad in master_grads.values():
                if grad.dtype == torch.float32:
                    grad.mul_(unscale)
        norm, totals = self._global_grad_norm(master_grads, sums, unscale)
        overflow = not math.isfinite(norm)
        self.scaler.update(overflow)
        if not overflow:
            clip = self.settings.optimizer.clip_grad
            self.placement.step(master_grads, min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0, lr, unscale)
            self._publish_params()
        self.zero_grad()
        self.placement.zero_grad()
        return StepResult(grad_norm=norm, skipped=overflow, loss_scale=self.scaler.scale, sums=totals)

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

    def _weight_decay(self, group: GroupState) -> float:
        return self.settings.optimizer.weight_decay if group.decays else 0.0

    def _build_placement(self) -> Placement:
        """The spec's optimizer on the device over the groups' master pieces, or (ZeRO-Offload) the master
        and optimizer states of every group moved off it: each group's master becomes the host tensor (NVMe:
        an empty placeholder outside `materialized_states()`)."""
        zero, opt, spec = self.settings.zero, self.settings.optimizer, self.settings.optimizer_spec
        # the optimizer's whole-matrix step over the groups of whole matrices (Muon; None: there are none)
        self.whole_matrices = whole = whole_matrix_step(self.groups, self.dp, self.tp, spec, opt, self.device)
        if zero.offload_optimizer == "none":
            fused = self.settings.fused_optimizer
            return DevicePlacement(self.groups, FlatOptimizer(
                [FlatTensor(piece, self._weight_decay(group), name, offset, group.matrix)
                 for name, group in self.groups.items() for offset, piece in group.master_pieces], spec, opt,
                fused=self.device.type == "cuda" if fused is None else fused, orthogonalize=whole))
        on_host = zero.offload_optimizer == "cpu"  # NVMe keeps host memory bounded: its gradients stay
        specs = [GroupSpec(name, group.master(), self._param_pieces(group), self._weight_decay(group),
                           holds_grad=on_host and group.bucketed, matrix=group.matrix)
                 for name, group in self.groups.items()]
        placement = (HostOffload(specs, opt, self.copier, spec, whole) if on_host
                     else NvmeOffload(specs, opt, self.copier, zero.nvme_path, zero.nvme_buffer_bytes, self.world.rank,
                                      spec))
        for spec in specs:
            group = self.groups[spec.name]
            group.master_pieces = ((0, placement.master(spec.name)),)
            if spec.holds_grad:  # the device gradient shard is freed: the host one replaces it
                group.grads, group.grads_per_step = placement.grad(spec.name), False
        return placement

    def _param_pieces(self, group: GroupState) -> tuple:
        """The model-dtype parameter elements matching the group's master coordinates, as
        ((offset, tensor), ...): the whole tensor when the master covers it, else this rank's pieces."""
        master_numel = sum(piece.numel() for _, piece in group.master_pieces)
        if master_numel == group.param_flat.numel():
            return ((0, group.param_flat),)
        return tuple((bucket.shard_start, group.param_flat[lo:hi]) for bucket, lo, hi in group.layout.pieces(self.dp.rank))

    def _deliver_grad_piece(self, group: GroupState, lo: int, piece: torch.Tensor) -> None:
        """Stages 2/3 (zero3d/buckets.py): a reduced bucket piece for shard elements [lo, lo + n),
        added (× post-scale) into the gradient shard wherever the placement keeps it (hybrid: the
        node's sum; summed across the nodes once per step, `_all_reduce_shards_across_nodes`)."""
        self.grad_shard(group)
        self.placement.accumulate_grad(group, lo, piece, self.post_scale)

    def grad_shard(self, group: GroupState) -> torch.Tensor:
        """The group's gradients; a shard allocated per step (`grads_per_step`) is allocated here, zeros, at the step's
        first reduced piece (or at the step, after a step without backward)."""
        if group.grads is None:
            group.grads = torch.zeros(group.layout.shard_numel, dtype=self.settings.dtype, device=self.device)
        return group.grads

    def _all_reduce_shards_across_nodes(self, groups: list) -> None:
        """Hybrid, stages 2/3: each bucketed group's gradient shard, accumulated over the step's
        micro-batches inside the node, summed over its replicas on the other nodes: one all-reduce per
        bucket piece per step (all in flight at once), not one per micro-batch."""
        self.plan.sum_across_replicas([group.grads[bucket.shard_start:bucket.shard_start + bucket.piece_numel]
                                       for group in groups for bucket in group.buckets])

    def materialized_states(self):
        """Context: inside it every master and `optimizer.state` is a tensor (NVMe: read from the
        files, written back on exit). Checkpoint code reads and writes them only inside it."""
        return self.placement.materialized()

    def masters_loaded(self) -> None:
        """After the masters (and Adam states) were overwritten, e.g. by a checkpoint load: the
        model-dtype parameters follow. NVMe: call inside `materialized_states()`."""
        self.placement.after_load()  # offloaded: host masters into the device parameter pieces
        self._publish_params()

    def close(self) -> None:
        """Removes the engine's hooks from the model (they hold the engine: a cycle through autograd's C++ state
        that the garbage collector cannot see, which kept every flat buffer alive) and releases the placement's
        files and I/O thread (also done when the process ends)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        self.placement.close()

    def _sum_tied_grads(self, tied: Optional[dict] = None) -> None:
        """Stages keeping whole gradients (0, 1; stage 3's persistent ones: `tied`) sum tied ones over their
        group once per step; stages 2/3 sum each micro-batch's before it is bucketed (finish_backward)."""
        for param, comm in (self.tied if tied is None else tied).items():
            comm.all_reduce(param.grad, tag="tied_grads")

    def _norm_ranges(self, layout: FlatLayout, flat: bool) -> tuple:
        """Ranges of this rank's shard to count (in flat coordinates when the master is the whole
        buffer, else in shard coordinates): TP-duplicated parameters count on TP rank 0 only."""
        return tuple((flat_lo, flat_hi) if flat else (shard_lo, shard_lo + flat_hi - flat_lo)
                     for slot, flat_lo, flat_hi, shard_lo in layout.owned_slot_ranges(self.dp.rank)
                     if (slot.tp_partitioned or self.tp_rank == 0) and slot.name not in self._norm_excluded)

    def _global_grad_norm(self, master_grads: dict, sums: Optional[torch.Tensor], unscale: float = 1.0
                          ) -> tuple[float, tuple]:
        """(global gradient norm, `sums` summed over the world group): one all-reduce, one host read. `unscale`: the
        factor gradients kept in the compute dtype still need."""
        squares = torch.zeros(1, dtype=torch.float64, device=self.device)
        for name, group in self.groups.items():
            grad = master_grads[name]  # (on the host for gradient shards held there)
            squares += sum_of_squares([grad[lo:hi] for lo, hi in group.norm_ranges], unscale).to(squares.device)
        if self.plan.replica_count > 1:  # hybrid: every node holds the same shards; count them once
            squares /= self.plan.replica_count
        local = (squares if sums is None
                 else torch.cat((squares, sums.detach().reshape(-1).to(device=self.device, dtype=torch.float64))))
        self.world.all_reduce(local, tag="grad_norm")
        total, *totals = self.settings.read_host_floats(local)
        return (math.sqrt(total) if math.isfinite(total) else float("inf")), tuple(totals)

    def state_bytes(self) -> dict:
        """Model-state bytes per category on the device; with offload also host_* / nvme_* keys."""
        out = self._state_bytes()
        placement = self.settings.zero.offload_params
        if placement != "none":  # stage 3's parameter shards live on the host or in files
            out[("host_" if placement == "cpu" else "nvme_") + "params"], out["params"] = out["params"], 0
        return self.placement.state_bytes(out)

    def _state_bytes(self) -> dict:
        return model_state_bytes(self.groups.values(), self.optimizer)

    # ------------------------------------------------------------ replicated groups (stage 0, stage 3's small ones)

    def _replicated_group(self, name: str, named_params: list, decays: bool, matrix: bool = False) -> GroupState:
        """Full parameters, gradients, master and optimizer states on every rank."""
        layout = self._layout(named_params)
        params = [p for _, p in named_params]
        dtype = self.settings.dtype
        group = GroupState(name, layout, params, decays, matrix=matrix)
        group.param_flat = flatten_params(layout, params, dtype, self.device)
        group.grads = flatten_grads(layout, params, dtype, self.device)
        # fp32 models train their own storage; fp16/bf16 ones get a full fp32 master copy.
        master = group.param_flat if dtype == torch.float32 else group.param_flat.float()
        group.master_pieces = ((0, master),)
        # Each DP rank counts its own pieces, so the norm sums every element once.
        group.norm_ranges = self._norm_ranges(layout, flat=True)
        return group

    def _all_reduce_replicated(self, groups: list) -> None:
        """One all-reduce per bucket of replicated groups' gradients, pre/post-divided."""
        for group in groups:
            if self.pre_scale != 1.0:
                group.grads.mul_(self.pre_scale)
        wait_all([self.dp.all_reduce(group.grads[bucket.start:bucket.end], tag="grads", async_op=True)
                  for group in groups for bucket in group.buckets])
        self.plan.sum_across_replicas([group.grads[bucket.start:bucket.end]  # hybrid: summed across nodes
                                       for group in groups for bucket in group.buckets])
        for group in groups:
            if self.post_scale != 1.0:
                group.grads.mul_(self.post_scale)

    # ------------------------------------------------------------ stage hooks

    def _build_groups(self, named_groups: dict) -> dict:
        """{name: GroupState}; stages 0-2 keep one group per kind ("decay", "no_decay"; "matrix", "matrix_no_decay"
        for the parameters the optimizer takes whole)."""
        return {group_kind(*kind): self._build_group(group_kind(*kind), named, *kind)
                for kind, named in named_groups.items()}

    def _layout(self, named_params: list) -> FlatLayout:
        return FlatLayout(named_params, self.dp.size, self.settings.zero.bucket_elements)

    def _build_group(self, name: str, named_params: list, decays: bool, matrix: bool = False) -> GroupState:
        raise NotImplementedError

    def _reduce_grads(self) -> None:
        raise NotImplementedError

    def _master_grad(self, group: GroupState) -> torch.Tensor:
        """The group's reduced gradient in master coordinates, where the placement keeps it for the step (the compute
        dtype on the device; default: from its whole gradient tensor)."""
        return self.placement.master_grad(group.name, [group.grads])

    def _publish_params(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        for group in self.groups.values():
            if group.grads_per_step:
                group.grads = None
            else:
                group.grads.zero_()


__all__ = ["DataParallelEngine", "EngineSettings", "GroupState", "ParallelGroups", "StepResult", "read_host_floats"]
