"""zero3d's communication layer: every collective it issues, counted (volume, calls) and timed."""
import time
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from zero3d.comm.quantize import QuantSpec, pack, unpack_into
from zero3d.comm.topology import node_of_rank


def all_gather_single(**kwargs):
    """torch.distributed's single-tensor all-gather by the name the installed torch offers (torch 2.13 calls it
    all_gather_single and warns, every call, on all_gather_into_tensor), looked up at each call: a counter that
    wraps torch.distributed's functions (bench/bench_zero.py's) sees it, as it sees every other collective."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(**kwargs)


def reduce_scatter_single(**kwargs):
    """The single-tensor reduce-scatter, by name at each call as `all_gather_single`."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(**kwargs)


@dataclass
class CommStats:
    """Elements sent per rank, by (collective, purpose), as the paper counts them (§3), and time.

    all-reduce of n elements over N ranks: 2n(N-1)/N; reduce-scatter, all-gather and reduce
    (to one owner): n(N-1)/N, n being the full (unsharded) size. Fractions keep it exact.

    Per link (only for collectives issued with a node topology; none given: nothing is split): the
    bytes a rank sends are intra-node or inter-node by `ring_link_split`'s model for ring
    collectives, and exactly per peer for all-to-alls; reported as comm/intra_node_bytes,
    comm/inter_node_bytes and per (collective, purpose).

    Time: a collective's span runs from its launch to its completion — seen by `poll()` (called
    from the engine's forward/backward hooks, so on the compute timeline) or by its wait. The
    exposed part is what the training thread spent blocked in waits and synchronous calls;
    hidden fraction = 1 − exposed / span. On CUDA a wait only orders streams, so there the
    exposed time counts host-side blocking only.
    """

    elements: dict = field(default_factory=lambda: defaultdict(Fraction))
    bytes: dict = field(default_factory=lambda: defaultdict(Fraction))
    calls: dict = field(default_factory=lambda: defaultdict(int))
    seconds: float = 0.0  # summed launch → completion spans
    exposed_seconds: float = 0.0  # summed time the caller was blocked on communication
    in_flight: list = field(default_factory=list)
    link_bytes: dict = field(default_factory=lambda: defaultdict(Fraction))  # (op, tag, "intra"|"inter")

    def add(self, op: str, tag: str, volume: Fraction, element_size: int, nodes: Optional[list] = None) -> None:
        """A ring collective sending `volume` elements of `element_size` bytes; `nodes`: the node of
        each group rank in ring (group-rank) order, to split its bytes per link."""
        nbytes = volume * element_size
        split = ring_link_split(nbytes, nodes) if nodes is not None else None
        self.record(op, tag, volume, nbytes, split)

    def record(self, op: str, tag: str, elements: Fraction, nbytes: Fraction,
               link: Optional[tuple[Fraction, Fraction]] = None) -> None:
        """One call: `elements` logical elements, `nbytes` on the wire, `link` its (intra, inter) bytes."""
        self.elements[(op, tag)] += elements
        self.bytes[(op, tag)] += nbytes
        self.calls[(op, tag)] += 1
        if link is not None:
            if sum(link) != nbytes:
                raise ValueError(f"link bytes {link} do not add up to the {nbytes} bytes sent")
            self.link_bytes[(op, tag, "intra")] += link[0]
            self.link_bytes[(op, tag, "inter")] += link[1]

    def total(self, tags: Optional[tuple[str, ...]] = None) -> Fraction:
        return sum((v for (op, tag), v in self.elements.items() if tags is None or tag in tags),
                   Fraction(0))

    def poll(self) -> None:
        """Note the completion time of every in-flight collective that has finished by now."""
        now = time.perf_counter()
        for pending in self.in_flight:
            if pending.done_at is None and pending.is_completed():
                pending.done_at = now
                self.seconds += now - pending.launched_at
        self.in_flight = [p for p in self.in_flight if p.done_at is None]

    def hidden_fraction(self) -> Optional[float]:
        """Share of communication time that overlapped compute (None before any was timed)."""
        if self.seconds <= 0:
            return None
        return max(0.0, 1.0 - self.exposed_seconds / self.seconds)

    def report(self) -> dict[str, float]:
        """Flat metrics: comm/<collective>/<purpose>/{elements,bytes,calls}, totals and timing."""
        out = {}
        for (op, tag), v in self.elements.items():
            out[f"comm/{op}/{tag}/elements"] = float(v)
            out[f"comm/{op}/{tag}/bytes"] = float(self.bytes[(op, tag)])
            out[f"comm/{op}/{tag}/calls"] = self.calls[(op, tag)]
        out["comm/total/elements"] = float(self.total())
        out["comm/total/bytes"] = float(sum(self.bytes.values(), Fraction(0)))
        out["comm/total/calls"] = sum(self.calls.values())
        if self.link_bytes:
            for (op, tag, link), v in self.link_bytes.items():
                out[f"comm/{op}/{tag}/{link}_node_bytes"] = float(v)
            for link in ("intra", "inter"):
                out[f"comm/{link}_node_bytes"] = float(sum((v for (_, _, lk), v in self.link_bytes.items()
                                                            if lk == link), Fraction(0)))
        hidden = self.hidden_fraction()
        if hidden is not None:
            out["comm/time/seconds"] = self.seconds
            out["comm/time/exposed_seconds"] = self.exposed_seconds
            out["comm/time/hidden_fraction"] = hidden
        return out

    def reset(self) -> None:
        """Start a new step's counts (collectives still in flight keep being timed)."""
        self.elements.clear()
        self.bytes.clear()
        self.calls.clear()
        self.link_bytes.clear()
        self.seconds = self.exposed_seconds = 0.0


def ring_link_split(nbytes: Fraction, nodes: list) -> tuple[Fraction, Fraction]:
    """(intra-node, inter-node) share of the `nbytes` a rank sends in a ring collective over ranks on
    `nodes` (each group rank's node, in ring = group-rank order).

    Model: a ring of n ranks has n edges; the c edges whose two ends are on different nodes cross
    (c = k for a group spanning k > 1 nodes in consecutive blocks, c = n when every rank is on its own
    node, 0 inside one node). Every edge carries the same bytes, and the rings of the node's GPUs
    (NCCL's channels, one per NIC) spread the crossings over the ranks, so each rank counts c/n of
    what it sends as inter-node and the rest as intra-node. Summed over a node's m = n/k ranks of a
    k-node group: m·(c/n) = 1 rank's full send volume crosses its NICs, e.g. an all-gather of S bytes
    puts S(n−1)/n on each node's inter-node links.
    """
    n = len(nodes)
    crossings = sum(nodes[r] != nodes[(r + 1) % n] for r in range(n)) if n > 1 else 0
    inter = Fraction(nbytes) * crossings / n if n else Fraction(0)
    return Fraction(nbytes) - inter, inter


class PendingCollective:
    """A collective in flight — one torch work, or several acting as one (gloo's reduce-scatter as reduces) —
    when it was launched, and an optional step run once after it completes (a copy into place, a
    dequantization): the one handle type zero3d's asynchronous collectives return."""

    def __init__(self, works, stats: CommStats, then: Optional[Callable[[], None]] = None):
        self.works = list(works) if isinstance(works, (list, tuple)) else [works]
        self.stats, self.then = stats, then
        self.launched_at = time.perf_counter()
        self.done_at: Optional[float] = None
        stats.in_flight.append(self)

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        if self.done_at is None:
            started = time.perf_counter()
            for work in self.works:
                work.wait()
            self.done_at = time.perf_counter()
            self.stats.exposed_seconds += self.done_at - started
            self.stats.seconds += self.done_at - self.launched_at
            self.stats.in_flight = [p for p in self.stats.in_flight if p is not self]
        else:  # seen complete by poll(): only surface a failure, if any
            for work in self.works:
                work.wait()
        if self.then is not None:
            then, self.then = self.then, None
            then()


class Comm:
    """Collectives over one process group; each call is recorded in a shared CommStats."""

    def __init__(self, group, stats: CommStats, gpus_per_node: Optional[int] = None):
        """`gpus_per_node`: each global rank is on its node by topology.node_of_rank (the one rule), and every call's
        bytes are split per link; None: counted as before, no split."""
        self.group = group
        self.stats = stats
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._global_ranks = ([dist.get_global_rank(group, r) for r in range(self.size)]
                              if group is not None else list(range(self.size)))
        self._nodes = [node_of_rank(g, gpus_per_node) for g in self._global_ranks] if gpus_per_node else None
        self._gloo = is_gloo(group)

    def record_into(self, stats: CommStats) -> None:
        """Count (and time) this Comm's later calls in `stats`: an object built before the CommStats it joins
        (a model's, before the engine's) is pointed at it."""
        self.stats = stats

    def _record(self, op: str, tag: str, tensor: torch.Tensor, factor: int = 1) -> None:
        if self.size > 1:
            volume = Fraction(factor * tensor.numel() * (self.size - 1), self.size)
            self.stats.add(op, tag, volume, tensor.element_size(), self._nodes)

    def _issue(self, collective, async_op: bool, **kwargs) -> Optional[PendingCollective]:
        """Run a torch collective: async → a PendingCollective; sync → timed as fully exposed."""
        if async_op:
            return PendingCollective(collective(group=self.group, async_op=True, **kwargs), self.stats)
        started = time.perf_counter()
        collective(group=self.group, **kwargs)
        spent = time.perf_counter() - started
        self.stats.seconds += spent
        self.stats.exposed_seconds += spent
        return None

    def all_reduce(self, tensor: torch.Tensor, tag: str, op=dist.ReduceOp.SUM, async_op=False):
        self._record("all_reduce", tag, tensor, factor=2)
        if self.size == 1:
            return None
        return self._issue(dist.all_reduce, async_op, tensor=tensor, op=op)

    def reduce_scatter(self, piece: torch.Tensor, full: torch.Tensor, tag: str, async_op=False):
        """Sum `full` over the group; this rank's piece (len(full) / size) lands in `piece`, which
        may be a view of `full` (in place). Others' pieces of `full` are left as scratch.

        gloo: issued as one reduce of each piece to its owner — the same n(N−1)/N elements. Under an
        earlier torch that was much faster than gloo's reduce_scatter (500k fp32 elements: 2 ms against
        25 ms on 2 ranks, 13 ms against 74 ms on 4). Under torch 2.13 (2-core CI machine, 2026-11-29) the
        two are equal on 2 ranks; on 4, gloo's own is ~1.8× faster at 4k–400k elements and ~10% slower
        at 4M. Swapped in, it left the dist tier's CPU time unchanged (four files, 255 CPU-s either
        way) and moved 4-rank sums in the last bit, so the reduces stay.
        NCCL: one reduce_scatter, in place."""
        self._record("reduce_scatter", tag, full)
        if self.size == 1:
            if not same_memory(piece, full):
                piece.copy_(full)
            return None
        if not self._gloo:
            return self._issue(reduce_scatter_single, async_op, output=piece, input=full)
        size = piece.numel()
        works = [dist.reduce(full[owner * size:(owner + 1) * size], dst=self._global_ranks[owner],
                             group=self.group, async_op=True) for owner in range(self.size)]
        mine = full[self.rank * size:(self.rank + 1) * size]
        pending = PendingCollective(works, self.stats, then=None if same_memory(piece, mine) else partial(piece.copy_, mine))
        return pending if async_op else pending.wait()

    def all_gather(self, full: torch.Tensor, piece: torch.Tensor, tag: str, async_op=False):
        self._record("all_gather", tag, full)
        if self.size == 1:
            if not same_memory(full, piece):
                full.copy_(piece)
            return None
        return self._issue(all_gather_single, async_op, output_tensor=full, input_tensor=piece)

    def all_gather_float8(self, full: torch.Tensor, piece: torch.Tensor, tag: str, async_op=False):
        """Float8 codes all-gathered as they are (stage 3's zero.fp8_gather): one byte an element, sent as uint8
        (gloo and NCCL move bytes), counted as "fp8_all_gather", a ring all-gather of those bytes."""
        self._record("fp8_all_gather", tag, full)
        if self.size == 1:
            if not same_memory(full, piece):
                full.copy_(piece)
            return None
        return self._issue(all_gather_single, async_op, output_tensor=full.view(torch.uint8),
                           input_tensor=piece.view(torch.uint8))

    def all_gather_quantized(self, full: torch.Tensor, piece: torch.Tensor, spec: QuantSpec, tag: str,
                             async_op=False, check_finite=True):
        """qwZ: every rank's `piece` quantized (zero3d/comm/quantize.py), all-gathered as codes + scales,
        dequantized into `full` (piece r at full[r·n:(r+1)·n]) — after `wait()` when `async_op`. Counted as a
        ring all-gather of the quantized bytes. `check_finite=False` skips quantize's host-reading refusal:
        a block holding a non-finite value then arrives non-finite throughout, never as finite garbage."""
        n = piece.numel()
        if full.numel() != n * self.size:
            raise ValueError(f"full has {full.numel()} elements; expected {self.size} × {n} (group size × piece)")
        buf = pack(piece, spec, check_finite)
        if self.size > 1:
            nbytes = Fraction(buf.numel() * self.size * (self.size - 1), self.size)
            self.stats.record("quantized_all_gather", tag, Fraction(n * (self.size - 1)), nbytes,
                              ring_link_split(nbytes, self._nodes) if self._nodes is not None else None)
        gathered = torch.empty(self.size * buf.numel(), dtype=torch.uint8, device=buf.device)
        work = all_gather_single(output_tensor=gathered, input_tensor=buf, group=self.group, async_op=async_op)
        dequantize = partial(unpack_into, full, gathered, self.size, spec)
        if async_op:
            return PendingCollective(work, self.stats, then=dequantize)
        dequantize()
        return None

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, tag: str, op: str = "all_to_all",
                   elements: Optional[Fraction] = None) -> None:
        """Equal-split all-to-all (synchronous): row p of `inp` (viewed [size, -1]) goes to group rank p, row
        p of `out` comes from it. Counted exactly per peer: (size − 1) rows sent, intra- or inter-node by the
        peer's node; `elements`: the logical elements they stand for (quantized codes: fewer than bytes)."""
        row_bytes = inp.numel() // self.size * inp.element_size()
        if self.size > 1:
            mine = self._nodes[self.rank] if self._nodes is not None else None
            inter = sum(row_bytes for p in range(self.size) if p != self.rank and self._nodes is not None
                        and self._nodes[p] != mine)
            sent = Fraction(row_bytes * (self.size - 1))
            self.stats.record(op, tag, Fraction(inp.numel() // self.size * (self.size - 1)) if elements is None
                              else Fraction(elements), sent,
                              (sent - inter, Fraction(inter)) if self._nodes is not None else None)
        started = time.perf_counter()
        all_to_all(out, inp, self.group)
        spent = time.perf_counter() - started
        self.stats.seconds += spent
        self.stats.exposed_seconds += spent


    def all_to_all_v(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list, in_splits: list, tag: str) -> None:
        """Uneven all-to-all (synchronous): `in_splits[p]` elements of `inp`, in group-rank order, go to group rank
        p, `out_splits[p]` of `out` come from it. Counted exactly: the elements sent to the other ranks, intra- or
        inter-node by each peer's node."""
        if self.size > 1:
            sent = Fraction(sum(n for p, n in enumerate(in_splits) if p != self.rank))
            nbytes = sent * inp.element_size()
            link = None
            if self._nodes is not None:
                mine = self._nodes[self.rank]
                inter = Fraction(sum(n for p, n in enumerate(in_splits) if p != self.rank and self._nodes[p] != mine)
                                 * inp.element_size())
                link = (nbytes - inter, inter)
            self.stats.record("all_to_all", tag, sent, nbytes, link)
        if self.size == 1:
            out.copy_(inp)
            return
        started = time.perf_counter()
        dist.all_to_all_single(out, inp, list(out_splits), list(in_splits), group=self.group)
        spent = time.perf_counter() - started
        self.stats.seconds += spent
        self.stats.exposed_seconds += spent


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` are views of the same elements (by storage identity and offset, not data_ptr(), which
    fake tensors — the rank-local probe — all report as 0)."""
    return (a.untyped_storage() is b.untyped_storage() and a.storage_offset() == b.storage_offset()
            and a.numel() == b.numel())


def wait_all(handles: list) -> None:
    """Wait for every collective in `handles` (None entries: ones that ran synchronously); empties it."""
    for handle in handles:
        if handle is not None:
            handle.wait()
    handles.clear()


def is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """Equal-split all-to-all: torch's all_to_all_single where the backend has it (gloo does in torch
    2.13), else the same bytes as paired sends and receives to every peer."""
    try:
        dist.all_to_all_single(out, inp, group=group)
        return
    except (RuntimeError, NotImplementedError) as err:
        if "all_to_all" not in str(err) and "alltoall" not in str(err).lower():
            raise
    p2p_all_to_all(out, inp, group)


def p2p_all_to_all(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """all_to_all_single as one isend/irecv pair per peer (the same bytes on the same links)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    ins, outs = inp.view(size, -1), out.view(size, -1)
    outs[rank].copy_(ins[rank])
    ops = []
    for peer in range(1, size):
        to, frm = (rank + peer) % size, (rank - peer) % size
        g_to, g_frm = (dist.get_global_rank(group, r) if group is not None else r for r in (to, frm))
        ops += [dist.P2POp(dist.isend, ins[to].contiguous(), g_to, group),
                dist.P2POp(dist.irecv, outs[frm], g_frm, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
