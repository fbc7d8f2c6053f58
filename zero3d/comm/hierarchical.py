"""qgZ: the hierarchical reduce-scatter — quantized all-to-alls inside the node, then across nodes — issued through `Comm`."""
from typing import Optional

import torch
import torch.distributed as dist

from zero3d.comm.core import Comm
from zero3d.comm.quantize import QuantSpec, pack, unpack


def _quantized_exchange(parts: torch.Tensor, comm: Comm, spec: QuantSpec, tag: str, check_finite: bool) -> torch.Tensor:
    """parts: [size, c] fp32, row p for group rank p. Each row quantized and sent to its owner by one
    all-to-all; returns the fp32 sum of the rows this rank received (its own row unquantized)."""
    size, c = parts.shape
    bufs = torch.stack([pack(parts[p], spec, check_finite) for p in range(size)])
    received = torch.empty_like(bufs)
    comm.all_to_all(received.view(-1), bufs.view(-1), tag, op="quantized_all_to_all", elements=c * (size - 1))
    total = parts[comm.rank].clone()
    for p in range(size):
        if p != comm.rank:
            total += unpack(received[p], c, spec)
    return total


def quantized_reduce_scatter(piece: torch.Tensor, full: torch.Tensor, intra: Optional[Comm], inter: Optional[Comm],
                             spec: QuantSpec = QuantSpec(bits=4), tag: str = "grads", check_finite: bool = True) -> None:
    """qgZ: the sum of `full` over k nodes × m ranks (`intra`: this rank's node, m ranks; `inter`: the ranks of
    its local index on every node, k; None: a group of one); this rank's len(full)/(k·m) elements land in `piece`.

    All-to-all based, accumulating in fp32: with `full` as chunks [k, m, c] (chunk (i, j) owned by the rank
    at local index j of node i), (1) inside the node, rank j receives every local peer's chunks (·, j)
    quantized and sums them; (2) across nodes, rank (i, j) receives every node's partial sum of chunk (i, j)
    quantized and sums them. Error per element ≤ Σ over the m·k senders of (1) of their block scale / 2 +
    Σ over the k senders of (2) of theirs (QuantSpec's bound; a rank's own contribution is never
    quantized). Inter-node bytes per rank: (k − 1) · wire_bytes(c); per node (m ranks): (k − 1)/k of one
    quantized copy of `full`. `check_finite=False`: `full` is known finite (quantize's host read skipped).
    """
    m = intra.size if intra is not None else 1
    k = inter.size if inter is not None else 1
    ranks = k * m
    if full.numel() % ranks or piece.numel() != full.numel() // ranks:
        raise ValueError(f"full has {full.numel()} elements and piece {piece.numel()}; expected a multiple of "
                         f"the group size {ranks} and 1/{ranks} of it")
    c = full.numel() // ranks
    chunks = full.detach().float().reshape(k, m, c)
    intra_parts = chunks.permute(1, 0, 2).reshape(m, k * c)  # row j = chunks (·, j), for local rank j
    partial = _quantized_exchange(intra_parts, intra, spec, tag, check_finite) if m > 1 else intra_parts[0].clone()
    # row i = this local index's chunk of node i
    mine = _quantized_exchange(partial.view(k, c), inter, spec, tag, check_finite) if k > 1 else partial
    piece.copy_(mine.view_as(piece))


def overflow_safe_quantized_reduce_scatter(piece: torch.Tensor, buffer: torch.Tensor, *, dp: Comm,
                                           intra: Optional[Comm], inter: Optional[Comm], spec: QuantSpec) -> None:
    """qgZ of one gradient bucket (synchronous), without a host read. A non-finite value has no scale, so the
    DP ranks agree on the device whether any holds one (fp16 overflow), quantize the bucket with those
    values as 0, and where one was found fill the reduced piece with inf on every rank: the engine's
    overflow rule then skips the step, on every rank alike."""
    bad = (~torch.isfinite(buffer)).any().to(torch.float32).reshape(1)
    dp.all_reduce(bad, tag="grads_overflow", op=dist.ReduceOp.MAX)
    torch.nan_to_num(buffer, nan=0.0, posinf=0.0, neginf=0.0, out=buffer)
    quantized_reduce_scatter(piece, buffer, intra, inter, spec, tag="grads", check_finite=False)
    piece.masked_fill_(bad > 0, float("inf"))
