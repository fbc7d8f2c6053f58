"""α-β model of collectives over a DGX-2-style cluster: NVSwitch inside a node, InfiniBand between nodes."""
from collections import defaultdict
from fractions import Fraction
from dataclasses import dataclass


@dataclass(frozen=True)
class Links:
    """Link settings (defaults: the paper's cluster, facts §4.1). Bandwidths in bytes/s.

    The latencies are assumptions (the paper states none): a few microseconds per ring step
    on NVSwitch, about twice that over InfiniBand.
    """

    gpus_per_node: int = 16
    nvswitch_bandwidth: float = 300e9  # per GPU inside a node (NVSwitch, 300 GB/s per link)
    nvswitch_latency: float = 5e-6  # seconds per ring step (assumed)
    ib_bandwidth_per_node: float = 8 * 100e9 / 8  # 8 × 100 Gb/s InfiniBand EDR per node
    ib_latency: float = 10e-6  # seconds per ring step (assumed)

    def __post_init__(self):
        for name in ("gpus_per_node", "nvswitch_bandwidth", "ib_bandwidth_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} = {getattr(self, name)} is invalid; must be > 0")
        for name in ("nvswitch_latency", "ib_latency"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} = {getattr(self, name)} is invalid; must be >= 0")


PAPER_LINKS = Links()

# Ring algorithms: (bytes on the wire per rank ÷ payload, ring steps), for n ranks.
RING = {"allreduce": lambda n: (2 * (n - 1) / n, 2 * (n - 1)),
        "allgather": lambda n: ((n - 1) / n, n - 1),
        "reduce_scatter": lambda n: ((n - 1) / n, n - 1),
        "reduce": lambda n: ((n - 1) / n, n - 1),
        "broadcast": lambda n: ((n - 1) / n, n - 1)}


def ring_kind(op: str) -> str:
    """c10d op name (allreduce_, _allgather_base_, _reduce_scatter_base_, ...) → RING key."""
    name = op.strip("_").replace("_base", "").replace("_tensor", "").replace("_coalesced", "")
    for kind in RING:
        if name.startswith(kind):
            return kind
    raise ValueError(f"collective {op!r} has no α-β model; modelled: {', '.join(RING)}")


def spans_nodes(ranks, links: Links) -> bool:
    return len({r // links.gpus_per_node for r in ranks}) > 1


def collective_seconds(op: str, nbytes: int, ranks, links: Links = PAPER_LINKS) -> float:
    """α·steps + wire bytes / β for one ring collective of an `nbytes` payload over `ranks`.

    Inside a node β is the GPU's NVSwitch bandwidth. Across nodes every GPU of a node runs its own
    collective at once (TP groups fill a node, so DP groups stride across nodes), so β is the node's
    InfiniBand bandwidth shared by its GPUs.
    """
    n = len(ranks)
    if n <= 1:
        return 0.0
    wire, ring_steps = RING[ring_kind(op)](n)
    if spans_nodes(ranks, links):
        beta, alpha = links.ib_bandwidth_per_node / links.gpus_per_node, links.ib_latency
    else:
        beta, alpha = links.nvswitch_bandwidth, links.nvswitch_latency
    return alpha * ring_steps + wire * nbytes / beta


def comm_breakdown(collectives: list, links: Links = PAPER_LINKS) -> dict:
    """Seconds per (collective, link) over a rank's logged collectives (dicts: op, nbytes, ranks)."""
    out = defaultdict(float)
    for c in collectives:
        link = "IB" if spans_nodes(c["ranks"], links) else "NVSwitch"
        out[f"{ring_kind(c['op'])} over {link} (group of {len(c['ranks'])})"] += \
            collective_seconds(c["op"], c["nbytes"], c["ranks"], links)
    return dict(out)


def predicted_step_seconds(compute_seconds: float, collectives: list, links: Links = PAPER_LINKS) -> float:
    """Measured compute + every collective's α-β time, none overlapped (an upper bound: stage 2
    reduces during backward, which the paper overlaps)."""
    return compute_seconds + sum(comm_breakdown(collectives, links).values())


def dp_passes(stage: int, accumulation: int = 1) -> int:
    """Ψ(N_d−1)/N_d-element DP collectives per step with `accumulation` micro-batches per step.

    Stages 0 and 1 reduce the accumulated gradients once per step (all-reduce = reduce-scatter +
    all-gather; stage 1 reduce-scatter + parameter all-gather): 2. Stage 2 reduce-scatters each
    micro-batch's gradients during its backward, then all-gathers the parameters once: A + 1.
    Stage 3 gathers the parameters in each micro-batch's forward and backward and reduce-scatters its
    gradients: 3A.
    """
    if stage not in (0, 1, 2, 3) or accumulation < 1:
        raise ValueError(f"stage {stage} / accumulation {accumulation} is invalid; stage 0-3, accumulation >= 1")
    return {0: 2, 1: 2, 2: accumulation + 1, 3: 3 * accumulation}[stage]


def dp_elements_per_step(stage: int, psi: int, dp: int, accumulation: int = 1) -> float:
    """Elements each rank sends per step over the DP group (ring collectives): dp_passes × Ψ(N_d−1)/N_d."""
    return dp_passes(stage, accumulation) * psi * (dp - 1) / dp


# ---- ZeRO++ modes: bytes per link per step (stage 3), and their α-β step time ----------------------

ZEROPP_MODES = ("stage 3", "+hpZ", "+hybrid", "+qwZ", "+qgZ", "qwZ+hpZ+qgZ")


@dataclass(frozen=True)
class LinkCollective:
    """One collective a rank runs in a step: bytes it sends inside its node and across nodes, ring steps."""

    name: str
    intra_bytes: Fraction
    inter_bytes: Fraction
    steps: int


def _ring(name: str, nbytes: Fraction, n: int, m: int, ring_groups: int = 1) -> LinkCollective:
    """A ring collective sending `nbytes` per rank over n ranks, m per node in consecutive blocks:
    k = n/m nodes give k crossings of the n edges (n when m = 1), so inter = nbytes·k/n = nbytes/m
    (comm.ring_link_split's model); none inside one node."""
    k = n // m
    inter = Fraction(nbytes) / m if k > 1 else Fraction(0)
    return LinkCollective(name, Fraction(nbytes) - inter, inter, ring_groups * (n - 1))


def zeropp_collectives(mode: str, psi: int, dp: int, per_node: int, value_bytes: int = 2,
                       weight_bits: int = 8, grad_bits: int = 4, block: int = 256, scale_bytes: int = 4,
                       accumulation: int = 1) -> list:
    """The DP collectives one rank runs per step at stage 3 in `mode` (ZEROPP_MODES), with the bytes it
    sends on each link: Ψ = psi parameters (of this rank's TP slice), N = dp ranks, m = per_node of
    them per node, k = N/m nodes, b = value_bytes, q_w / q_g = quantized bytes per element
    (bits/8 + scale_bytes/block).

    stage 3: per micro-batch a forward and a backward all-gather and a reduce-scatter, each sending
    Ψb(N−1)/N — per node 3Ψb(N−1)/N across nodes. +hpZ: the backward all-gather runs inside the node
    from the node's secondary shards: Ψb(m−1)/m, all intra. +hybrid: shards inside the node only
    (both gathers and the reduce-scatter over m ranks), then the Ψ/m gradient shard all-reduced across
    the k nodes once per step: 2(Ψb/m)(k−1)/k, all inter. +qwZ: both all-gathers send Ψ·q_w(N−1)/N.
    +qgZ: the reduce-scatter is quantization.quantized_reduce_scatter's two all-to-alls: inside the node
    (m−1) chunks of Ψ/m·q_g, then across nodes (k−1) chunks of Ψ/N·q_g. qwZ+hpZ+qgZ: the three together.
    """
    if mode not in ZEROPP_MODES:
        raise ValueError(f"mode {mode!r} is invalid; valid: {', '.join(ZEROPP_MODES)}")
    if dp < 1 or per_node < 1 or dp % per_node:
        raise ValueError(f"dp = {dp} with {per_node} per node is invalid; dp must be a multiple of per_node >= 1")
    n, m, k, a = dp, per_node, dp // per_node, accumulation
    full = Fraction(psi * value_bytes)
    q_w = Fraction(weight_bits, 8) + Fraction(scale_bytes, block)
    q_g = Fraction(grad_bits, 8) + Fraction(scale_bytes, block)
    ring = Fraction(n - 1, n)
    hpz, qwz, qgz = (mode in ("+hpZ", "qwZ+hpZ+qgZ"), mode in ("+qwZ", "qwZ+hpZ+qgZ"),
                     mode in ("+qgZ", "qwZ+hpZ+qgZ"))
    if mode == "+hybrid":
        node_ring = Fraction(m - 1, m)
        out = [_ring("all_gather fwd (node)", full * node_ring, m, m, a),
               _ring("all_gather bwd (node)", full * node_ring, m, m, a),
               _ring("reduce_scatter (node)", full * node_ring, m, m, a)]
        if k > 1:
            shard = full / m
            out.append(LinkCollective("all_reduce (across nodes)", Fraction(0), 2 * shard * Fraction(k - 1, k),
                                      2 * (k - 1)))
        return out
    gather = psi * q_w * ring if qwz else full * ring
    out = [_ring("all_gather fwd" + (" (qwZ)" if qwz else ""), gather * a, n, m, a)]
    if hpz:
        out.append(_ring("all_gather bwd (node, hpZ)", full * Fraction(m - 1, m) * a, m, m, a))
    else:
        out.append(_ring("all_gather bwd" + (" (qwZ)" if qwz else ""), gather * a, n, m, a))
    if qgz:
        out.append(LinkCollective("all_to_all (node, qgZ)", Fraction(psi, m) * q_g * (m - 1) * a, Fraction(0),
                                  a * (m - 1)))
        out.append(LinkCollective("all_to_all (across nodes, qgZ)", Fraction(0),
                                  Fraction(psi, n) * q_g * (k - 1) * a, a * (k - 1)))
    else:
        out.append(_ring("reduce_scatter", full * ring * a, n, m, a))
    return out


def link_bytes(collectives: list) -> tuple[Fraction, Fraction]:
    """(intra-node, inter-node) bytes one rank sends over `collectives`."""
    return (sum((c.intra_bytes for c in collectives), Fraction(0)),
            sum((c.inter_bytes for c in collectives), Fraction(0)))


H100_LINKS = Links(gpus_per_node=8, nvswitch_bandwidth=900e9,  # NVLink 4, 900 GB/s per GPU (as the V100's 300)
                   ib_bandwidth_per_node=8 * 400e9 / 8)  # 8 × 400 Gb/s NDR per node


def link_seconds(c: LinkCollective, links: Links) -> float:
    """α-β time of one collective: α per ring step (InfiniBand's when it sends across nodes) plus the
    slower of its two links, which run at once: intra bytes at the GPU's NVSwitch bandwidth, inter
    bytes at the GPU's share of its node's InfiniBand (every GPU of a node runs its own DP group's
    collective at the same time)."""
    alpha = links.ib_latency if c.inter_bytes else links.nvswitch_latency
    return alpha * c.steps + max(float(c.intra_bytes) / links.nvswitch_bandwidth,
                                 float(c.inter_bytes) * links.gpus_per_node / links.ib_bandwidth_per_node)
