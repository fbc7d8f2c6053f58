"""`CommPlan`: how an engine's data-parallel collectives run, decided once from the modes and the node topology."""
from typing import Optional

import torch
import torch.distributed as dist

from zero3d.comm.core import Comm, CommStats, wait_all
from zero3d.comm.hierarchical import overflow_safe_quantized_reduce_scatter
from zero3d.comm.modes import NODE_AWARE_KEYS, CommModes
from zero3d.comm.quantize import QuantSpec
from zero3d.comm.topology import NodeTopology


class CommPlan:
    """The DP group's collectives for one engine.

    `shard`: the Comm whose ranks hold one shard each (the DP group; hybrid: this rank's node);
    `dp_size`: the ranks gradients are averaged over (always the whole DP group);
    `secondary`: hpZ's node Comm, whose ranks each keep 1/`secondary.size` of every gathered bucket (else None).
    """

    def __init__(self, modes: CommModes, dp_group, stats: CommStats, node: Optional[NodeTopology] = None,
                 gpus_per_node: Optional[int] = None, quant_block: int = 256, float8_gather: bool = False):
        """`node`: the DP group's NodeTopology with its sub-groups (zero3d/comm/topology.py), needed by every
        node-aware mode; `gpus_per_node` (without a topology): only to split each collective's bytes per link;
        `float8_gather` (zero.fp8_gather): stage 3 gathers the FP8 linear weights as float8 codes."""
        self.modes, self.stats = modes, stats
        self.float8_gather = float8_gather
        gpus_per_node = node.gpus_per_node if node is not None else gpus_per_node
        self.dp = Comm(dp_group, stats, gpus_per_node=gpus_per_node)
        self.dp_size = self.dp.size
        _check_node_modes(modes, node, self.dp.size)
        node_comm = (lambda group: Comm(group, stats, gpus_per_node=gpus_per_node) if group is not None else None)
        intra = node_comm(node.intra_group) if modes.node_aware else None
        inter = node_comm(node.inter_group) if modes.node_aware else None
        self.shard = intra if modes.hybrid else self.dp
        self.replicas = inter if modes.hybrid else None  # None also for hybrid on one node: nothing to sum
        self.secondary = intra if modes.secondary_partition else None
        self._weights = QuantSpec(bits=modes.weight_bits, block=quant_block) if modes.weight_bits else None
        self._grads = QuantSpec(bits=modes.grad_bits, block=quant_block) if modes.grad_bits else None
        self._intra, self._inter = intra, inter

    @property
    def replica_count(self) -> int:
        """How many ranks hold the same shard (hybrid: the nodes; else 1): each counts it in the norm."""
        return self.replicas.size if self.replicas is not None else 1

    def reduce_scatter(self, piece: torch.Tensor, bucket: torch.Tensor, async_op: bool):
        """A gradient bucket summed over the shard group, this rank's piece landing in `piece` (a view of
        `bucket`); qgZ: the quantized hierarchical reduce-scatter (synchronous: None)."""
        if self._grads is not None:
            overflow_safe_quantized_reduce_scatter(piece, bucket, dp=self.shard, intra=self._intra, inter=self._inter,
                                                   spec=self._grads)
            return None
        return self.shard.reduce_scatter(piece, bucket, tag="grads", async_op=async_op)

    def gathers_plainly(self, phase: str) -> bool:
        """Whether `gather` in this phase is the shard group's plain all-gather (a GPU caller may put those on
        its side stream)."""
        return not (self.secondary is not None and phase == "params_bwd") and self._weights is None

    def gather(self, full: torch.Tensor, piece: torch.Tensor, phase: str, secondary: Optional[torch.Tensor] = None,
               async_op: bool = True):
        """A parameter bucket gathered into `full` from every shard's `piece`; `phase` ("params", "params_bwd",
        "params_eval") is also its tag. hpZ's backward gathers run over the node from `secondary` (this rank's
        node-local slice); qwZ's are quantized (dequantized when waited for), without quantize's host-reading
        finiteness check (a step never publishes non-finite parameters)."""
        if self.secondary is not None and phase == "params_bwd":
            return self.secondary.all_gather(full, secondary, tag=phase, async_op=async_op)
        if self._weights is not None:
            return self.shard.all_gather_quantized(full, piece, self._weights, phase, async_op=async_op,
                                                   check_finite=False)
        return self.shard.all_gather(full, piece, tag=phase, async_op=async_op)

    def reduce_float8_amax(self, amax: torch.Tensor) -> None:
        """zero.fp8_gather: each weight's amax, the max over the shard group (in place; tag "fp8_amax")."""
        self.shard.all_reduce(amax, tag="fp8_amax", op=dist.ReduceOp.MAX)

    def gather_float8(self, full: torch.Tensor, piece: torch.Tensor, phase: str, async_op: bool = True):
        """zero.fp8_gather: a bucket of float8 codes gathered into `full` over the shard group (tag `phase`)."""
        return self.shard.all_gather_float8(full, piece, tag=phase, async_op=async_op)

    def sum_across_replicas(self, pieces: list) -> None:
        """Hybrid: each tensor in `pieces` (a gradient shard's pieces) summed over the ranks holding the same
        shard on the other nodes, all in flight at once; otherwise nothing."""
        if self.replicas is not None:
            wait_all([self.replicas.all_reduce(piece, tag="grads", async_op=True) for piece in pieces])


def _check_node_modes(modes: CommModes, node: Optional[NodeTopology], dp_size: int) -> None:
    """The node-aware modes need the DP group's NodeTopology, and hpZ / hybrid >= 2 DP ranks per node."""
    if not modes.node_aware:
        return
    if node is None:
        raise ValueError(f"{NODE_AWARE_KEYS} need the DP group's node topology "
                         "(ParallelGroups.node_topology, zero3d.comm.topology.build_node_topology); none was given")
    if node.dp_size != dp_size:
        raise ValueError(f"the node topology covers {node.dp_size} DP ranks; the DP group has {dp_size}")
    problem = modes.node_layout_error(node.per_node, node.gpus_per_node)
    if problem:
        raise ValueError(problem)
