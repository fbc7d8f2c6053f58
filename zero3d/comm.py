"""zero3d's communication layer: every collective it issues, counted at its bandwidth-optimal volume."""
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class CommStats:
    """Elements sent per rank, by (collective, purpose), as the paper counts them (§3).

    all-reduce of n elements over N ranks: 2n(N-1)/N; reduce-scatter, all-gather and reduce
    (to one owner): n(N-1)/N, n being the full (unsharded) size. Fractions keep it exact.
    """

    elements: dict = field(default_factory=lambda: defaultdict(Fraction))
    bytes: dict = field(default_factory=lambda: defaultdict(Fraction))
    calls: dict = field(default_factory=lambda: defaultdict(int))

    def add(self, op: str, tag: str, volume: Fraction, element_size: int) -> None:
        self.elements[(op, tag)] += volume
        self.bytes[(op, tag)] += volume * element_size
        self.calls[(op, tag)] += 1

    def total(self, tags: Optional[tuple[str, ...]] = None) -> Fraction:
        return sum((v for (op, tag), v in self.elements.items() if tags is None or tag in tags),
                   Fraction(0))

    def report(self) -> dict[str, float]:
        """Flat metrics: comm/<collective>/<purpose>/{elements,bytes} and the totals."""
        out = {}
        for (op, tag), v in self.elements.items():
            out[f"comm/{op}/{tag}/elements"] = float(v)
            out[f"comm/{op}/{tag}/bytes"] = float(self.bytes[(op, tag)])
        out["comm/total/elements"] = float(self.total())
        out["comm/total/bytes"] = float(sum(self.bytes.values(), Fraction(0)))
        return out

    def reset(self) -> None:
        self.elements.clear()
        self.bytes.clear()
        self.calls.clear()


class Comm:
    """Collectives over one process group; each call is recorded in a shared CommStats."""

    def __init__(self, group, stats: CommStats):
        self.group = group
        self.stats = stats
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._global_ranks = [dist.get_global_rank(group, r) for r in range(self.size)] \
            if group is not None else list(range(self.size))

    def _record(self, op: str, tag: str, tensor: torch.Tensor, factor: int = 1) -> None:
        if self.size > 1:
            volume = Fraction(factor * tensor.numel() * (self.size - 1), self.size)
            self.stats.add(op, tag, volume, tensor.element_size())

    def all_reduce(self, tensor: torch.Tensor, tag: str, op=dist.ReduceOp.SUM, async_op=False):
        self._record("all_reduce", tag, tensor, factor=2)
        if self.size == 1:
            return None
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def reduce(self, tensor: torch.Tensor, owner_rank: int, tag: str, async_op=False):
        """Sum `tensor` onto `owner_rank` (a rank of this group); others' copies become scratch."""
        self._record("reduce", tag, tensor)
        if self.size == 1:
            return None
        return dist.reduce(tensor, dst=self._global_ranks[owner_rank], group=self.group,
                           async_op=async_op)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, tag: str, async_op=False):
        self._record("reduce_scatter", tag, full)
        if self.size == 1:
            shard.copy_(full)
            return None
        return dist.reduce_scatter_tensor(shard, full, group=self.group, async_op=async_op)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, tag: str, async_op=False):
        self._record("all_gather", tag, full)
        if self.size == 1:
            if full.data_ptr() != shard.data_ptr():
                full.copy_(shard)
            return None
        return dist.all_gather_into_tensor(full, shard, group=self.group, async_op=async_op)
