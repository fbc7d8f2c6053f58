"""Block-wise symmetric int8 / int4 quantization and the quantized collectives built on it (qwZ, qgZ)."""
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

import torch
import torch.distributed as dist

from zero3d.comm.core import all_gather_single, ring_link_split

LEVELS = {8: 127, 4: 7}  # largest magnitude of a code: q ∈ [−LEVELS, LEVELS]
SCALE_DTYPES = {torch.float32: 4, torch.float16: 2}


@dataclass(frozen=True)
class QuantSpec:
    """How a tensor is quantized: `bits` (8 or 4), `block` elements per scale, the scale's dtype.

    Every block of `block` consecutive elements (the last padded with zeros) gets
    scale = max|block| / 127 (int8) or / 7 (int4), and each element x the code q = round(x / scale);
    dequantized, x' = q · scale, so |x − x'| ≤ scale / 2 (plus one rounding of fp32 arithmetic). An fp16
    scale is rounded up to the next fp16 value, so |x| / scale still fits the codes and the bound holds
    with the stored scale. int4 codes are stored as q + 8 in a nibble, two per byte (block must be even).
    """

    bits: int = 8
    block: int = 256
    scale_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        if self.bits not in LEVELS:
            raise ValueError(f"bits = {self.bits!r} is invalid; valid: 8, 4")
        if type(self.block) is not int or self.block < 1 or (self.bits == 4 and self.block % 2):
            raise ValueError(f"block = {self.block!r} is invalid; must be an integer >= 1 (even for int4)")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype = {self.scale_dtype} is invalid; valid: torch.float32, torch.float16")

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def code_bytes(self, numel: int) -> int:
        """Bytes of the codes of `numel` elements (padded to whole blocks)."""
        padded = self.blocks(numel) * self.block
        return padded if self.bits == 8 else padded // 2

    def wire_bytes(self, numel: int) -> int:
        """Bytes a quantized tensor of `numel` elements occupies: codes + one scale per block."""
        return self.code_bytes(numel) + self.blocks(numel) * SCALE_DTYPES[self.scale_dtype]


def quantize(x: torch.Tensor, spec: QuantSpec = QuantSpec(),
             check_finite: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a flat view of `x`: int8 codes (int4: uint8, two per byte), one scale per block.
    Refuses non-finite input (a scale of inf or nan would silently poison every element of its block);
    that check reads the host: `check_finite=False` skips it, for callers whose input is finite already
    (the engine's qgZ zeroes non-finite gradients on the device first, having agreed on them; its qwZ
    gathers parameters, which a step never leaves non-finite)."""
    flat = x.detach().reshape(-1).float()
    if check_finite and not bool(torch.isfinite(flat).all()):
        bad = flat[~torch.isfinite(flat)][0].item()
        raise ValueError(f"cannot quantize a tensor holding {bad}: only finite values have a scale")
    nblocks = spec.blocks(flat.numel())
    padded = torch.zeros(nblocks * spec.block, dtype=torch.float32, device=flat.device)
    padded[:flat.numel()] = flat
    blocks = padded.view(nblocks, spec.block)
    scales = blocks.abs().amax(dim=1) / LEVELS[spec.bits]
    if spec.scale_dtype == torch.float16:
        if bool((scales > torch.finfo(torch.float16).max).any()):
            raise ValueError(f"block maximum {scales.max().item() * LEVELS[spec.bits]:g} overflows an fp16 scale; "
                             "use scale_dtype torch.float32")
        half = scales.half()
        low = half.float() < scales  # rounded down: step up one fp16 value so every code fits
        up = half[low].float()
        half[low] = torch.nextafter(up, torch.full_like(up, float("inf"))).half()
        scales = half
    divisor = scales.float().clone()
    divisor[divisor == 0] = 1.0  # an all-zero block: codes 0, scale 0
    codes = torch.round(blocks / divisor[:, None]).clamp_(-LEVELS[spec.bits], LEVELS[spec.bits]).to(torch.int8)
    if spec.bits == 4:
        nibbles = (codes + 8).to(torch.uint8).view(-1, 2)
        codes = nibbles[:, 0] | (nibbles[:, 1] << 4)
    return codes.reshape(-1), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, numel: int, spec: QuantSpec = QuantSpec()) -> torch.Tensor:
    """The fp32 values of `numel` elements from `quantize`'s (codes, scales)."""
    if spec.bits == 4:
        low = (codes & 0x0F).to(torch.int16) - 8
        high = (codes >> 4).to(torch.int16) - 8
        values = torch.stack((low, high), dim=1).reshape(-1)
    else:
        values = codes
    blocks = values.float().view(-1, spec.block) * scales.float()[:, None]
    return blocks.reshape(-1)[:numel]


def _pack(x: torch.Tensor, spec: QuantSpec, check_finite: bool = True) -> torch.Tensor:
    """One uint8 buffer: codes then scales' bytes (so one collective carries both)."""
    codes, scales = quantize(x, spec, check_finite)
    return torch.cat((codes.view(torch.uint8), scales.contiguous().view(torch.uint8)))


def _unpack(buf: torch.Tensor, numel: int, spec: QuantSpec) -> torch.Tensor:
    n_codes = spec.code_bytes(numel)
    codes = buf[:n_codes].view(torch.int8 if spec.bits == 8 else torch.uint8)
    scales = buf[n_codes:spec.wire_bytes(numel)].clone().view(spec.scale_dtype)
    return dequantize(codes, scales, numel, spec)


def _count(stats, op: str, tag: str, elements: Fraction, nbytes: Fraction, link) -> None:
    """One call: `elements` logical elements this rank sent as `nbytes` quantized bytes, `link` their
    (intra, inter) split or None (no topology). None stats: not counted."""
    if stats is not None:
        stats.record(op, tag, Fraction(elements), Fraction(nbytes), link)


class PendingDequantize:
    """A quantized all-gather in flight: `wait()` waits for its bytes, then dequantizes every rank's piece
    into `full` (once). Acts as a torch work handle (`wait`, `is_completed`) for comm.PendingCollective."""

    def __init__(self, work, gathered: torch.Tensor, full: torch.Tensor, size: int, spec: "QuantSpec"):
        self.work, self.gathered, self.full, self.size, self.spec = work, gathered, full, size, spec

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = None
            _dequantize_into(self.full, self.gathered, self.size, self.spec)
        return True


def _dequantize_into(full: torch.Tensor, gathered: torch.Tensor, size: int, spec: "QuantSpec") -> None:
    """Rank r's packed chunk of `gathered` dequantized into full[r·n:(r+1)·n], n = len(full) / size."""
    n = full.numel() // size
    out = full.view(size, n)
    for r, chunk in enumerate(gathered.view(size, -1)):
        out[r].copy_(_unpack(chunk, n, spec))


def quantized_all_gather(full: torch.Tensor, piece: torch.Tensor, group=None, spec: QuantSpec = QuantSpec(),
                         stats=None, tag: str = "params", topology=None, check_finite: bool = True,
                         async_op: bool = False) -> Optional[PendingDequantize]:
    """qwZ: every rank's `piece` quantized, all-gathered as codes + scales, dequantized into `full`
    (fp32 arithmetic, then `full`'s dtype); piece r lands at full[r·len(piece):(r+1)·len(piece)].
    `async_op`: returns a PendingDequantize at once (the bytes in flight); `full` holds the values after
    its `wait()`, as a prefetched plain all-gather's does.

    Counted as a ring all-gather of the quantized bytes (comm.ring_link_split); `topology`: the
    NodeTopology whose nodes the group's ranks are on (the DP group or a sub-group of it).
    `check_finite=False` skips quantize's host-reading refusal: a block holding a non-finite value
    then arrives non-finite throughout (its scale is inf or nan), never as finite garbage."""
    size = dist.get_world_size(group)
    n = piece.numel()
    if full.numel() != n * size:
        raise ValueError(f"full has {full.numel()} elements; expected {size} × {n} (group size × piece)")
    buf = _pack(piece, spec, check_finite)
    gathered = torch.empty(size * buf.numel(), dtype=torch.uint8, device=buf.device)
    work = all_gather_single(output_tensor=gathered, input_tensor=buf, group=group, async_op=async_op)
    nodes = _group_nodes(group, topology)
    if size > 1:
        nbytes = Fraction(buf.numel() * size * (size - 1), size)
        _count(stats, "quantized_all_gather", tag, Fraction(n * (size - 1)), nbytes,
               ring_link_split(nbytes, nodes) if nodes is not None else None)
    if async_op:
        return PendingDequantize(work, gathered, full, size, spec)
    _dequantize_into(full, gathered, size, spec)
    return None


def _group_nodes(group, topology) -> Optional[list[int]]:
    """Node of each rank of `group` (in group order) by the NodeTopology's rule; None: no topology."""
    if topology is None:
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return [g // topology.gpus_per_node for g in ranks]


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


def _quantized_exchange(parts: torch.Tensor, group, spec: QuantSpec, stats, tag: str, nodes,
                        check_finite: bool = True) -> torch.Tensor:
    """parts: [size, c] fp32, row p for group rank p. Each row quantized and sent to its owner by one
    all-to-all; returns the fp32 sum of the rows this rank received (its own row unquantized)."""
    size, rank = parts.shape[0], dist.get_rank(group)
    c = parts.shape[1]
    bufs = torch.stack([_pack(parts[p], spec, check_finite) for p in range(size)])
    received = torch.empty_like(bufs)
    all_to_all(received.view(-1), bufs.view(-1), group)
    total = parts[rank].clone()
    for p in range(size):
        if p != rank:
            total += _unpack(received[p], c, spec)
    per_peer = bufs.shape[1]
    inter = sum(per_peer for p in range(size) if p != rank and nodes[p] != nodes[rank])
    _count(stats, "quantized_all_to_all", tag, Fraction(c * (size - 1)), Fraction(per_peer * (size - 1)),
           (Fraction(per_peer * (size - 1) - inter), Fraction(inter)))
    return total


def quantized_reduce_scatter(piece: torch.Tensor, full: torch.Tensor, topology, spec: QuantSpec = QuantSpec(bits=4),
                             stats=None, tag: str = "grads", check_finite: bool = True) -> None:
    """qgZ: the sum of `full` over the DP group; this DP rank's len(full)/dp_size elements land in `piece`.

    Hierarchical, all-to-all based, accumulating in fp32: with k nodes of m DP ranks and `full` as
    chunks [k, m, c] (chunk (i, j) owned by DP rank i·m + j), (1) inside the node, rank j receives every
    local peer's chunks (·, j) quantized and sums them; (2) across nodes, rank (i, j) receives every
    node's partial sum of chunk (i, j) quantized and sums them. Error per element ≤ Σ over the m·k
    senders of (1) of their block scale / 2 + Σ over the k senders of (2) of theirs (QuantSpec's
    bound; a rank's own contribution is never quantized). Inter-node bytes per rank:
    (k − 1) · wire_bytes(c); per node (m ranks): (k − 1)/k of one quantized copy of `full`.
    `check_finite=False`: `full` is known finite (quantize's host-reading check skipped).
    """
    k, m = topology.nodes, topology.per_node
    if full.numel() % topology.dp_size or piece.numel() != full.numel() // topology.dp_size:
        raise ValueError(f"full has {full.numel()} elements and piece {piece.numel()}; expected a multiple of "
                         f"the DP size {topology.dp_size} and 1/{topology.dp_size} of it")
    c = full.numel() // topology.dp_size
    chunks = full.detach().float().reshape(k, m, c)
    # (1) intra-node: row j = chunks (·, j), for local rank j
    intra_parts = chunks.permute(1, 0, 2).reshape(m, k * c)
    if m > 1:
        partial = _quantized_exchange(intra_parts, topology.intra_group, spec, stats, tag,
                                      [topology.node] * m, check_finite)
    else:
        partial = intra_parts[0].clone()
    # (2) inter-node: row i = this local index's chunk of node i
    if k > 1:
        mine = _quantized_exchange(partial.view(k, c), topology.inter_group, spec, stats, tag, list(range(k)),
                                   check_finite)
    else:
        mine = partial
    piece.copy_(mine.view_as(piece))


def overflow_safe_quantized_reduce_scatter(piece: torch.Tensor, buffer: torch.Tensor, async_op: bool, *, dp,
                                           topology, spec: QuantSpec, stats=None) -> None:
    """qgZ of one gradient bucket (zero3d/buckets.py's reduction; synchronous), without a host read. A
    non-finite value has no scale, so the DP ranks (`dp`: zero3d.comm.Comm) agree on the device whether
    any holds one (fp16 overflow), quantize the bucket with those values as 0, and where one was found
    fill the reduced piece with inf on every rank: the engine's overflow rule then skips the step, on
    every rank alike."""
    bad = (~torch.isfinite(buffer)).any().to(torch.float32).reshape(1)
    dp.all_reduce(bad, tag="grads_overflow", op=dist.ReduceOp.MAX)
    torch.nan_to_num(buffer, nan=0.0, posinf=0.0, neginf=0.0, out=buffer)
    quantized_reduce_scatter(piece, buffer, topology, spec, stats, tag="grads", check_finite=False)
    piece.masked_fill_(bad > 0, float("inf"))
