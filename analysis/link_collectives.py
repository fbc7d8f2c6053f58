"""A rank's collectives counted per link (inside its node, across nodes): `LinkCollective`, a ring's split of its
bytes between the links, the bytes of a quantized copy as the wire carries it, and `DPPass`, the quantities of one
step's DP collectives that the α-β model (comm_model.dp_collectives) and each mode's costs (analysis/modes.py)
read."""
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Sequence


@dataclass(frozen=True)
class LinkCollective:
    """Collectives a rank runs in a step for one purpose: bytes it sends inside its node and across nodes,
    ring steps summed over its `calls` collectives (each paying α per step), and what it carries:
    "grads" (the gradient reduction), "params" (parameter gathers) or "replicas" (hybrid's cross-node sum)."""

    name: str
    intra_bytes: Fraction
    inter_bytes: Fraction
    steps: int
    calls: int = 1
    purpose: str = ""


def ring_collective(name: str, nbytes: Fraction, n: int, m: int, calls: int, purpose: str,
                    steps_per_call: Optional[int] = None) -> LinkCollective:
    """`calls` ring collectives over n ranks, m per node in consecutive blocks, sending `nbytes` per rank in
    all: k = n/m nodes give k crossings of the n edges (n when m = 1), so inter = nbytes·k/n = nbytes/m
    (comm.ring_link_split's model); none inside one node. Steps: n − 1 per call unless given."""
    k = n // m
    inter = Fraction(nbytes) / m if k > 1 else Fraction(0)
    per_call = n - 1 if steps_per_call is None else steps_per_call
    return LinkCollective(name, Fraction(nbytes) - inter, inter, calls * per_call, calls, purpose)


def wire_bytes(numel: int, bits: int, block: int, scale_bytes: int) -> Fraction:
    """Bytes of `numel` quantized elements as sent: whole blocks of codes and one scale a block
    (zero3d.comm.quantize.QuantSpec.wire_bytes)."""
    blocks = -(-numel // block)
    return Fraction(blocks * block * bits, 8) + blocks * scale_bytes


def quantized_copy_bytes(psi: int, pieces: Optional[Sequence[int]], parts: int, bits: int, block: int,
                         scale_bytes: int) -> Fraction:
    """Bytes of one quantized copy of Ψ sent as `parts` equal chunks of each bucket: Ψ·(bits/8 + scale/block)
    without `pieces`; with them (the buckets' padded sizes), each chunk rounded up to whole blocks."""
    if pieces is None:
        return psi * (Fraction(bits, 8) + Fraction(scale_bytes, block))
    return sum((parts * wire_bytes(size // parts, bits, block, scale_bytes) for size in pieces), Fraction(0))


@dataclass(frozen=True)
class DPPass:
    """One step's DP collectives as comm_model.dp_collectives names their quantities: Ψ = psi parameters (`pieces`:
    the buckets' padded sizes, or None), n ranks the stage's rings run over (the DP group, or the node's under a mode
    that shards inside it), m of the DP group's ranks per node, k nodes, a = accumulation micro-batches, `buckets`
    collectives per bucketed pass, `gathers` per stage-3 gather pass, `full` = Ψb bytes, `ring` = (n − 1)/n, and the
    quantized formats (`weight_bits`, `grad_bits`, `block` elements a scale of `scale_bytes`)."""

    psi: int
    pieces: Optional[Sequence[int]]
    n: int
    m: int
    k: int
    a: int
    buckets: int
    gathers: int
    full: Fraction
    ring: Fraction
    weight_bits: int
    grad_bits: int
    block: int
    scale_bytes: int
