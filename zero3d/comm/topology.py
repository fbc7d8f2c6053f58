"""Node topology of the data-parallel group: the one rank → node rule and the DP group's node sub-groups."""
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional, Sequence

from zero3d.comm.gloo import lower_gloo_poller_priority


class TopologyError(ValueError):
    """The node layout is unknown or the DP group does not split evenly into nodes."""


def node_of_rank(global_rank: int, gpus_per_node: int) -> int:
    """The node global rank `global_rank` runs on: launchers place ranks node by node, `gpus_per_node` on each. The one
    rank → node rule: the node topology, the collectives' bytes per link, the memory check and the planner read it."""
    return global_rank // gpus_per_node


def dp_groups(world_size: int, tp: int, pp: int) -> list[list[int]]:
    """Every DP group's global ranks, in megatron-core's default order tp-cp-ep-dp-pp (cp = ep = 1):
    the rank at coordinates (t, d, p) is t + tp·(d + dp·p)."""
    dp = world_size // (tp * pp)
    return [[t + tp * (d + dp * p) for d in range(dp)] for p in range(pp) for t in range(tp)]


def dp_ranks_per_node(world_size: int, tp: int, pp: int, gpus_per_node: int) -> int:
    """The DP ranks on each node of the DP group holding global rank 0, in a world of `world_size` ranks at TP `tp` ×
    PP `pp`, by `node_of_rank` and megatron's order (`dp_groups`): what the engine's node topology holds on rank 0
    (node_layout), and what the memory check and the planner count with. A TopologyError when any DP group does not
    split evenly into nodes (every group is checked, as build_node_topology checks them)."""
    layouts = [node_layout(group, gpus_per_node) for group in dp_groups(world_size, tp, pp)]
    return len(layouts[0][0])


def node_layout(dp_global_ranks: Sequence[int], gpus_per_node: int) -> list[list[int]]:
    """The DP ranks (indices into `dp_global_ranks`) of each node the group touches, nodes in order.

    A global rank g lives on node_of_rank(g) = g // gpus_per_node (launchers place ranks node by node; megatron's
    TP-consecutive order then leaves gpus_per_node / tp DP ranks of a DP group on each node). Refused
    unless every node holds the same number of the group's ranks as one consecutive run of DP ranks
    (the hierarchical collectives index a rank as node × ranks_per_node + local).
    """
    if gpus_per_node < 1:
        raise TopologyError(f"gpus_per_node = {gpus_per_node} is invalid; must be >= 1")
    nodes: dict[int, list[int]] = {}
    for dp_rank, g in enumerate(dp_global_ranks):
        nodes.setdefault(node_of_rank(g, gpus_per_node), []).append(dp_rank)
    layout = [nodes[n] for n in sorted(nodes)]
    per_node = len(layout[0])
    uneven = any(len(ranks) != per_node for ranks in layout)
    scattered = any(ranks != list(range(i * per_node, (i + 1) * per_node)) for i, ranks in enumerate(layout))
    if uneven or scattered:
        raise TopologyError(
            f"the DP group (global ranks {list(dp_global_ranks)}) does not split evenly into nodes of "
            f"{gpus_per_node} ranks: DP ranks per node {[r for r in layout]}; valid: the same number of "
            "consecutive DP ranks on every node (check gpus_per_node and the TP size)")
    return layout


@dataclass
class NodeTopology:
    """Where this rank's DP group lives: `nodes` nodes of `per_node` DP ranks each.

    DP rank d is on node d // per_node at local index d % per_node. `intra_group` holds this rank's
    node's DP ranks, `inter_group` the DP ranks of the same local index on every node (None when a
    group would hold one rank only, or before `build_node_topology` made them).
    """

    dp_rank: int
    dp_size: int
    per_node: int
    dp_global_ranks: tuple
    gpus_per_node: int
    intra_group: object = field(default=None, repr=False)
    inter_group: object = field(default=None, repr=False)

    @property
    def nodes(self) -> int:
        return self.dp_size // self.per_node

    @property
    def node(self) -> int:
        return self.node_of(self.dp_rank)

    @property
    def local(self) -> int:
        return self.dp_rank % self.per_node

    def node_of(self, dp_rank: int) -> int:
        return dp_rank // self.per_node

    def intra_ranks(self, node: Optional[int] = None) -> list[int]:
        """DP ranks on `node` (this rank's node by default)."""
        node = self.node if node is None else node
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    def inter_ranks(self, local: Optional[int] = None) -> list[int]:
        """DP ranks at local index `local` (this rank's by default) on every node."""
        local = self.local if local is None else local
        return [n * self.per_node + local for n in range(self.nodes)]


def topology_of(dp_rank: int, dp_global_ranks: Sequence[int], gpus_per_node: int) -> NodeTopology:
    """The rank arithmetic alone (no groups): validated by `node_layout`."""
    layout = node_layout(dp_global_ranks, gpus_per_node)
    return NodeTopology(dp_rank=dp_rank, dp_size=len(dp_global_ranks), per_node=len(layout[0]),
                        dp_global_ranks=tuple(dp_global_ranks), gpus_per_node=gpus_per_node)


def agreed_minimum(*values: int) -> list[int]:
    """Each value's minimum over every rank, by one all_reduce (the fake backend's is a no-op: this rank's own)."""
    import torch
    import torch.distributed as dist
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mins = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(mins, op=dist.ReduceOp.MIN)
    return mins.tolist()


def build_node_topology(dp_group, gpus_per_node: int, timeout: Optional[timedelta] = None,
                        dp_groups: Optional[Sequence[Sequence[int]]] = None) -> NodeTopology:
    """This rank's NodeTopology with its intra- and inter-node sub-groups of `dp_group`, built once.

    Collective over the world: every rank calls it together. `dp_groups`: every DP group's global ranks
    (the caller's layout arithmetic; default: `dp_group` alone, which must then be the world). The ranks
    agree on `gpus_per_node` and on `dp_groups` holding each one's own DP group (one all_reduce of minima),
    every DP group is validated (every rank refuses the same bad layout), and every sub-group of every DP
    group is created by every rank in one agreed order with `timeout`.
    """
    import torch.distributed as dist
    mine = tuple(dist.get_process_group_ranks(dist.group.WORLD if dp_group is None else dp_group))
    groups = sorted({tuple(ranks) for ranks in dp_groups or [mine]})
    split = mine in groups and sorted(r for ranks in groups for r in ranks) == list(range(dist.get_world_size()))
    low, minus_high, all_split = agreed_minimum(gpus_per_node, -gpus_per_node, int(split))
    if low != -minus_high:
        raise TopologyError(f"ranks disagree on gpus_per_node: {sorted({low, -minus_high})}; "
                            "give the same value (or launcher environment) to every rank")
    if not all_split:
        raise TopologyError(f"the DP groups {[list(g) for g in groups]} do not split the world of "
                            f"{dist.get_world_size()} ranks with every rank's own DP group among them; valid: "
                            "every DP group's global ranks, each rank in exactly one")
    for ranks in groups:  # validate every DP group before creating anything, so all ranks refuse alike
        node_layout(ranks, gpus_per_node)
    topo = topology_of(mine.index(dist.get_rank()), mine, gpus_per_node)
    intra_lists, inter_lists = [], []
    for ranks in groups:
        t = topology_of(0, ranks, gpus_per_node)
        intra_lists += [[ranks[d] for d in t.intra_ranks(n)] for n in range(t.nodes)]
        inter_lists += [[ranks[d] for d in t.inter_ranks(j)] for j in range(t.per_node)]
    kwargs = {} if timeout is None else {"timeout": timeout}
    for name, lists in (("intra_group", intra_lists), ("inter_group", inter_lists)):
        for ranks in lists:  # same order on every rank; each rank keeps the one it belongs to
            group = dist.new_group(ranks, **kwargs) if len(ranks) > 1 else None
            if dist.get_rank() in ranks:
                setattr(topo, name, group)
    lower_gloo_poller_priority()  # the new groups' threads, on gloo
    return topo
