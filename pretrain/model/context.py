"""Exact causal attention over a CP group: K and V all-gathered in sequence order, each local chunk over its key prefix."""
import torch
from torch._subclasses.fake_tensor import FakeTensor

from pretrain.data.batch import context_chunk_indices
from zero3d.comm.core import Comm

TAG = "context_kv"  # the collectives' purpose in CommStats: comm/all_gather/context_kv/…, comm/reduce_scatter/…


def cp_chunks(rank: int, size: int) -> tuple[int, int]:
    """The two sequence chunks CP rank `rank` of `size` holds: the data's own rule (context_chunk_indices)."""
    return context_chunk_indices(size, rank)


def local_positions(rank: int, size: int, s_local: int, device=None) -> torch.Tensor:
    """The global sequence positions of this rank's `s_local` tokens (its two chunks, in the order it holds them)."""
    chunk = s_local // 2
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in cp_chunks(rank, size)])


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 through `comm` (rank r's piece at rows r·n … (r+1)·n); backward: each rank's piece's
    gradient is the sum over the group of the gathered gradients' rows r·n … (r+1)·n (a reduce-scatter). Both
    counted and timed by the Comm under TAG."""

    @staticmethod
    def forward(ctx, piece, comm: Comm):
        ctx.comm = comm
        piece = piece.contiguous()
        out = piece.new_empty((comm.size * piece.shape[0], *piece.shape[1:]))
        comm.all_gather(out.view(-1), piece.view(-1), TAG)
        return out

    @staticmethod
    def backward(ctx, grad):
        # Comm's gloo reduce-scatter leaves the others' rows of its input as scratch: `grad` is the buffer
        # autograd built for this backward alone (the chunk reordering's index backward), read by nothing else.
        grad = grad.contiguous()
        piece = grad.new_empty((grad.shape[0] // ctx.comm.size, *grad.shape[1:]))
        ctx.comm.reduce_scatter(piece.view(-1), grad.view(-1), TAG)
        return piece, None


def gather_sequence(k: torch.Tensor, v: torch.Tensor, comm: Comm) -> tuple[torch.Tensor, torch.Tensor]:
    """Every CP rank's K and V ([b, g, s_local, d] each; one all-gather for both, through `comm` over the CP
    group) as the whole sequence in order, [b, g, S, d] each: the gathered pieces are rank 0's two chunks, rank
    1's, …; chunk j of the sequence is the piece of the rank that holds it."""
    size, s_local = comm.size, k.shape[2]
    kv = torch.stack((k, v)).movedim(3, 0)  # [s_local, 2, b, g, d]: the sequence first, as the collective cuts it
    gathered = _GatherSequence.apply(kv, comm)  # [S, 2, b, g, d] in rank order
    held = [c for r in range(size) for c in cp_chunks(r, size)]  # the sequence chunk at each gathered chunk
    order = sorted(range(2 * size), key=held.__getitem__)  # the gathered chunk holding sequence chunk j
    chunks = gathered.view(2 * size, s_local // 2, *gathered.shape[1:])
    whole = chunks[order].flatten(0, 1).movedim(0, 3)  # [2, b, g, S, d]
    return whole[0], whole[1]


def context_parallel_attention(q, k, v, comm: Comm, scale=None, dropout=0.0, enable_gqa=False):
    """Causal attention of this CP rank's queries over the whole sequence: exactly full causal SDPA's rows for
    this rank's tokens. q [b, h, s_local, d], k and v [b, g, s_local, d] (g divides h; g < h only with
    `enable_gqa`), each rank's two chunks in the order it holds them; returns [b, h, s_local, d]. `comm`: a zero3d
    Comm over the CP group, which counts the K/V collectives (TAG).

    Each of the two local chunks (sequence chunk c, n tokens) attends to the key prefix that ends with it: chunks
    0 … c − 1 whole and chunk c causally, i.e. SDPA with torch's lower-right causal bias over (n, (c + 1)·n) — no
    mask tensor, the kernels' own causal masking with an offset, the groups unrepeated (enable_gqa)."""
    rank, size = comm.rank, comm.size
    s_local = q.shape[2]
    if s_local % 2:
        raise ValueError(f"context-parallel attention needs an even local sequence length (two equal chunks), "
                         f"got {s_local}")
    k, v = gather_sequence(k, v, comm)
    n, gqa = s_local // 2, enable_gqa and k.shape[1] != q.shape[1]
    outs = []
    for half, chunk in enumerate(cp_chunks(rank, size)):
        end = (chunk + 1) * n  # the keys this chunk's queries may see: every position up to its own last one
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[:, :, half * n:(half + 1) * n], k[:, :, :end], v[:, :, :end], **causal_to_the_end(n, end, q),
            dropout_p=dropout, scale=scale, **({"enable_gqa": True} if gqa else {})))
    return torch.cat(outs, dim=2)


def causal_to_the_end(n: int, end: int, like: torch.Tensor) -> dict:
    """SDPA's arguments for `n` queries that are the last n of `end` key positions: torch's lower-right causal
    bias — or, on fake tensors (the probe, pretrain/probe), `is_causal`.

    Fake tensors hold no values; what the probe measures is which tensors the call keeps for backward, and their
    shapes. On a GPU the lower-right bias runs the same fused op as `is_causal` (CausalBias._dispatch calls
    aten._scaled_dot_product_flash_attention with is_causal=True, flash's causal mask being lower right, or the
    memory-efficient kernel with its lower-right mask type), which keeps Q, the key and value prefix, the output
    and the logsumexp and no mask: what SDPA with `is_causal` over the same shapes keeps, on fake tensors too.
    The bias itself cannot be built under FakeTensorMode (CausalBias is a tensor subclass; nor under the probe's
    memory tracker), and built outside them, CPU's dispatch would materialize the [n, end] mask as the CPU kernel's
    bias in the query's dtype and keep it (n·end·e bytes a chunk: what a real CPU step holds, no GPU kernel)."""
    if isinstance(like, FakeTensor):
        return {"is_causal": True}
    from torch.nn.attention.bias import causal_lower_right  # here: it imports TorchDynamo (0.7 CPU-s a process)
    return {"attn_mask": causal_lower_right(n, end)}
