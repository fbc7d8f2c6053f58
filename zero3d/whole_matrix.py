"""The whole-matrix step (Muon under ZeRO and TP): each matrix's update computed from the WHOLE matrix's direction."""
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from optim.flat_optimizer import hyper_of
from zero3d.comm.core import Comm
from zero3d.flat import ParamSlot
from optim.matrix_owners import assign_owners, newton_schulz_cost


@dataclass(frozen=True)
class Matrix:
    """One matrix of a whole-matrix group: where each DP rank holds which elements of it (master coordinates)."""

    group: str
    slot: ParamSlot
    parts: tuple  # per DP rank: (lo, hi, at): elements [lo, hi) of the flattened TP-local matrix at master index `at`
    owner: int  # the DP rank computing it; -1: every rank (a replicated group holds it whole everywhere)

    def part(self, rank: int) -> Optional[tuple]:
        return self.parts[rank] if self.owner >= 0 else (0, self.slot.numel, self.slot.start)


def matrix_cost(slot: ParamSlot, tp_size: int) -> int:
    """Newton–Schulz's work on the whole matrix (its TP shards joined)."""
    shape = list(slot.shape)
    if slot.tp_partitioned:
        shape[slot.partition_dim] *= tp_size
    return newton_schulz_cost(*shape)


def layout_matrices(groups: list, dp_size: int, tp_size: int) -> list:
    """[Matrix] of `groups` = [(name, FlatLayout, replicated)], in group and slot order, owners assigned."""
    out, sharded = [], []
    for name, layout, replicated in groups:
        for slot in layout.slots:
            if replicated:
                out.append(Matrix(name, slot, (), -1))
                continue
            parts = []
            for rank in range(dp_size):
                ranges = [(lo - slot.start, hi - slot.start, at) for s, lo, hi, at in layout.owned_slot_ranges(rank)
                          if s.name == slot.name]
                parts.append(ranges[0] if ranges else None)
            sharded.append(len(out))
            out.append(Matrix(name, slot, tuple(parts), 0))
    owners = assign_owners([matrix_cost(out[i].slot, tp_size) for i in sharded], dp_size)
    for i, owner in zip(sharded, owners):
        out[i] = Matrix(out[i].group, out[i].slot, out[i].parts, owner)
    return out


class WholeMatrixStep:
    """The optimizer's `orthogonalize`: [(group, offset, direction piece)] -> [update piece], each matrix's update
    `transform(whole matrix)` computed as docs/engine.md says ("Muon's whole-matrix step"), over `dp` (the shard
    group) and `tp`."""

    def __init__(self, groups: list, dp: Comm, tp: Optional[Comm], transform: Callable, device: torch.device):
        self.dp, self.tp, self.transform, self.device = dp, tp, transform, device
        partitioned = [slot.name for _, layout, _ in groups for slot in layout.slots if slot.tp_partitioned]
        if tp is None and partitioned:
            raise ValueError(f"{partitioned[0]} is tensor-parallel, and the optimizer takes it whole: the engine needs "
                             "the TP group to join its shards (ParallelGroups.tp_group)")
        self.tp_size = tp.size if tp is not None else 1
        self.matrices = layout_matrices(groups, dp.size, self.tp_size)
        me = dp.rank
        self.computed = [m for m in self.matrices if m.owner in (me, -1)]
        self.exchanged = [m for m in self.matrices if m.owner >= 0]

    def _part_sizes(self, rank: int, owner: int) -> int:
        """Elements rank `rank` holds of the matrices `owner` owns."""
        return sum(m.parts[rank][1] - m.parts[rank][0] for m in self.exchanged
                   if m.owner == owner and m.parts[rank] is not None)

    def __call__(self, pieces: list) -> list:
        """`pieces` [(group, offset, direction)] is taken over and emptied: each direction is freed once it is sent
        (its caller keeps none), so about two fp32 copies of the larger of this rank's part of the matrices and the
        matrices it computes exist at once (docs/estimator.md, The optimizer step's moment). The updates come back
        where the directions were (the host, for ZeRO-Offload's step)."""
        templates = [(group, offset, (tensor.shape, tensor.device)) for group, offset, tensor in pieces]
        me, size = self.dp.rank, self.dp.size
        updates = self._transform(self._gather_owned(pieces, me, size))
        received, starts = self._send_back(updates, me, size)
        out = [torch.zeros(shape, dtype=torch.float32, device=device) for _, _, (shape, device) in templates]
        out_view = _viewer([(group, offset, tensor) for (group, offset, _), tensor in zip(templates, out)])
        for m in self.matrices:
            if m.owner == -1:
                out_view(m.group, m.slot.start, m.slot.numel).copy_(updates.pop(id(m)))
        self._place_received(received, starts, out_view, me)
        return out

    def _gather_owned(self, pieces: list, me: int, size: int) -> dict:
        """{id(matrix): its TP-local direction, flat fp32 on the device} of every matrix this rank computes; `pieces`
        emptied once sent."""
        view = _viewer(pieces)
        local = {}
        for m in self.matrices:
            if m.owner == -1:
                local[id(m)] = view(m.group, m.slot.start, m.slot.numel).to(self.device, torch.float32)
        if not self.exchanged:
            pieces.clear()
            return local
        sends = [[view(m.group, m.parts[me][2], m.parts[me][1] - m.parts[me][0]) for m in self.exchanged
                  if m.owner == owner and m.parts[me] is not None] for owner in range(size)]
        send = torch.cat([t.reshape(-1) for chunk in sends for t in chunk] or [torch.zeros(0)]).to(
            self.device, torch.float32)
        in_splits = [sum(t.numel() for t in chunk) for chunk in sends]
        del sends, view
        pieces.clear()  # the directions now live in `send` only (and the replicated matrices' in `local`)
        out_splits = [self._part_sizes(rank, me) for rank in range(size)]
        received = torch.empty(sum(out_splits), dtype=torch.float32, device=self.device)
        self.dp.all_to_all_v(received, send, out_splits, in_splits, tag="muon")
        del send
        starts = [sum(out_splits[:r]) for r in range(size)]
        for m in self.exchanged:
            if m.owner != me:
                continue
            flat = torch.zeros(m.slot.numel, dtype=torch.float32, device=self.device)
            for rank in range(size):
                part = m.parts[rank]
                if part is not None:
                    n = part[1] - part[0]
                    flat[part[0]:part[1]] = received[starts[rank]:starts[rank] + n]
                    starts[rank] += n
            local[id(m)] = flat
        return local

    def _transform(self, local: dict) -> dict:
        """{id(matrix): this TP rank's shard of transform(whole matrix), flat} for every matrix this rank computes,
        each replacing its direction in `local` (emptied) as it is made; the TP shards joined by one all-gather over
        the TP group."""
        joined = [m for m in self.computed if m.slot.tp_partitioned and self.tp_size > 1]
        gathered, at = None, {}
        if joined:
            mine = torch.cat([local.pop(id(m)) for m in joined])
            gathered = torch.empty(self.tp_size * mine.numel(), dtype=torch.float32, device=self.device)
            self.tp.all_gather(gathered, mine, tag="muon_tp")
            gathered = gathered.view(self.tp_size, -1)
            offset = 0
            for m in joined:
                at[id(m)] = offset
                offset += m.slot.numel
        out = {}
        for m in self.computed:
            shape, dim = m.slot.shape, m.slot.partition_dim
            if id(m) in at:
                lo = at[id(m)]
                shards = [gathered[r, lo:lo + m.slot.numel].view(shape) for r in range(self.tp_size)]
                whole = self.transform(torch.cat(shards, dim=dim))
                out[id(m)] = whole.chunk(self.tp_size, dim=dim)[self.tp.rank].reshape(-1).clone()  # not a view of whole
            else:
                out[id(m)] = self.transform(local.pop(id(m)).view(shape)).reshape(-1)
        return out

    def _send_back(self, updates: dict, me: int, size: int) -> tuple:
        """Every owner sends each rank the update of that rank's pieces of its matrices (the reverse all-to-all); the
        exchanged updates leave `updates` once sent. (what this rank received, where each owner's part starts)."""
        if not self.exchanged:
            return None, None
        sends = [[updates[id(m)][m.parts[rank][0]:m.parts[rank][1]] for m in self.exchanged
                  if m.owner == me and m.parts[rank] is not None] for rank in range(size)]
        send = torch.cat([t for chunk in sends for t in chunk] or [torch.zeros(0, device=self.device)])
        in_splits = [sum(t.numel() for t in chunk) for chunk in sends]
        del sends
        for m in self.exchanged:
            updates.pop(id(m), None)
        out_splits = [self._part_sizes(me, owner) for owner in range(size)]
        received = torch.empty(sum(out_splits), dtype=torch.float32, device=self.device)
        self.dp.all_to_all_v(received, send, out_splits, in_splits, tag="muon")
        return received, [sum(out_splits[:r]) for r in range(size)]

    def _place_received(self, received: Optional[torch.Tensor], starts: Optional[list], out_view: Callable,
                        me: int) -> None:
        """Each of this rank's parts of the exchanged matrices' updates, from `received`, into its output piece."""
        if received is None:
            return
        for m in self.exchanged:
            part = m.parts[me]
            if part is None:
                continue
            n = part[1] - part[0]
            out_view(m.group, part[2], n).copy_(received[starts[m.owner]:starts[m.owner] + n])
            starts[m.owner] += n


def whole_matrix_step(groups: dict, dp: Comm, tp: Optional[Comm], spec, config, device) -> Optional[WholeMatrixStep]:
    """The step over the engine's groups of whole matrices ({name: GroupState} with `matrix`, `layout` and
    `master_pieces`), transforming each matrix by the spec's matrix rule; None when no group holds whole matrices."""
    matrices = [(name, group.layout, replicated(group)) for name, group in groups.items() if group.matrix]
    if not matrices:
        return None
    hyper = hyper_of(spec, config)
    return WholeMatrixStep(matrices, dp, tp, lambda whole: spec.matrix.transform(whole, hyper), device)


def replicated(group) -> bool:
    """Its master covers the whole buffer on every DP rank (stage 0, stage 3's persistent groups), not a shard."""
    master_numel = sum(piece.numel() for _, piece in group.master_pieces)
    return master_numel == group.layout.padded_numel and group.layout.shard_numel != group.layout.padded_numel


def _viewer(pieces: list):
    """view(group, at, n): elements [at, at + n) of a group's flat buffer, as a view of the (group, offset, tensor)
    piece holding them all."""
    by_group = {}
    for group, offset, tensor in pieces:
        by_group.setdefault(group, []).append((offset, tensor))

    def view(group: str, at: int, n: int) -> torch.Tensor:
        for offset, tensor in by_group[group]:
            if offset <= at and at + n <= offset + tensor.numel():
                return tensor[at - offset:at - offset + n]
        raise AssertionError(f"elements [{at}, {at + n}) of group {group!r} lie in no piece handed over")
    return view
