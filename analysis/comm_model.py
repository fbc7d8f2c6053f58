"""α-β model of collectives over a DGX-2-style cluster: NVSwitch inside a node, InfiniBand between nodes."""
from collections import defaultdict
from fractions import Fraction
from dataclasses import dataclass
from typing import Optional, Sequence

from analysis.link_collectives import DPPass, LinkCollective, ring_collective  # noqa: F401 (LinkCollective: readers)
from analysis.modes import FLOAT8_REFUSED, mode_costs, named_modes, stage_modes
from zero3d.comm.topology import node_of_rank


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
    return len({node_of_rank(r, links.gpus_per_node) for r in ranks}) > 1


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
        out[f"{ring_kind(c['op'])} over {link} (group of {len(c['ranks'])})"] += (
            collective_seconds(c["op"], c["nbytes"], c["ranks"], links))
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


MUON_VALUE_BYTES = 4  # the directions and updates are exchanged in fp32


def muon_elements_per_step(matrix_params: int, dp: int, tp: int, stage: int) -> tuple:
    """(DP all-to-all, TP all-gather) elements one rank sends per optimizer step for Muon's whole-matrix step
    (zero3d/whole_matrix.py), as the balanced average: M = `matrix_params`, the rank's TP-local hidden-matrix
    parameters (GPTShape.hidden_matrix_params). Stages 1-3: a rank holds M/N of them, (N − 1)/N of that in matrices
    other ranks own, which it sends; as the owner of M/N worth it sends the other ranks' pieces back: 2·M(N − 1)/N²;
    it joins the TP shards of what it owns: (TP − 1)·M/N. Stage 0: no exchange, every rank joins everything:
    (TP − 1)·M."""
    if stage not in (0, 1, 2, 3) or dp < 1 or tp < 1:
        raise ValueError(f"stage {stage}, dp {dp}, tp {tp} is invalid; stage 0-3, dp and tp >= 1")
    m = Fraction(matrix_params)
    if stage == 0:
        return Fraction(0), (tp - 1) * m
    return 2 * m * (dp - 1) / dp ** 2, (tp - 1) * m / dp


def newton_schulz_flops(rows: int, cols: int, steps: int = 5) -> int:
    """One matrix's NS iterations: with r = min(rows, cols) and c the other side, each iteration's X·Xᵀ (2r²c), A·A
    (2r³) and (bA + cA²)·X (2r²c)."""
    r, c = min(rows, cols), max(rows, cols)
    return steps * (4 * r * r * c + 2 * r ** 3)


def context_bytes_per_step(*, seq: int, kv_width: int, layers: int, micro_batch: int, accumulation: int, tp: int,
                           cp: int, act_bytes: int, recompute: str) -> Fraction:
    """Bytes each rank sends per step over its context-parallel group of C = cp ranks (ring collectives): every
    layer of every micro-batch all-gathers K and V ([S, b, g, d] each, g·d = kv_width/tp on a TP rank) in its
    forward, 2·S·b·g·d·e·(C−1)/C, and reduce-scatters their gradients in backward, the same again; full
    recomputation repeats the forward's all-gather in backward: L·A·(2 + r)·2·S·b·g·d·e·(C−1)/C, r = 1 with
    recompute = "full", else 0 (A = accumulation micro-batches, e = act_bytes, L = layers)."""
    if recompute not in ("none", "full"):
        raise ValueError(f"recompute = {recompute!r} is invalid; valid values: 'none', 'full'")
    for name, value in (("seq", seq), ("kv_width", kv_width), ("layers", layers), ("micro_batch", micro_batch),
                        ("accumulation", accumulation), ("tp", tp), ("cp", cp), ("act_bytes", act_bytes)):
        if type(value) is not int or value < 1:
            raise ValueError(f"{name} = {value!r} is invalid; must be an integer >= 1")
    if kv_width % tp:
        raise ValueError(f"kv_width = {kv_width} is not divisible by tp = {tp}")
    gather = 2 * seq * micro_batch * Fraction(kv_width, tp) * act_bytes * Fraction(cp - 1, cp)
    return layers * accumulation * (3 if recompute == "full" else 2) * gather


# ---- Per-link DP collectives of every ZeRO stage (and ZeRO++ / hybrid modes), and their α-β time ------

# The modes the engine runs at each stage ("" = plain): hybrid sharding (zero.hybrid = "node") at 1-3,
# qgZ (zero.quantize_gradients) at 2-3, hpZ (zero.secondary_partition) and qwZ (zero.quantize_weights) at 3
STAGE_MODES = {stage: stage_modes(stage) for stage in range(4)}  # names: analysis/modes.py
PLAIN_ROW = "stage 3"
ZEROPP_MODES = (PLAIN_ROW,) + STAGE_MODES[3][1:]  # the --zeropp report's rows (PLAIN_ROW: plain stage 3)


def row_mode(row: str) -> str:
    """The mode name of a --zeropp report row ("" for plain stage 3)."""
    return "" if row == PLAIN_ROW else row


def collectives_per_pass(psi: int, bucket_elements: Optional[int], units: int) -> tuple[int, int]:
    """(B, G): collectives per pass over the Ψ parameters, as the engine issues them. Stages 0-2 keep a
    decay and a no-decay flat buffer, each cut into buckets of `bucket_elements` (zero3d/flat.py), one
    collective per bucket: B = ceil(Ψ/bucket) + 1 (the no-decay biases and norms fit one bucket; None =
    no CB: one fused buffer each, B = 2); stage 3 reduce-scatters the same B buckets. Stage 3 gathers
    each of its `units` units (pretrain: the embedding, every layer, the output layer) bucket by bucket,
    its decay group and its no-decay group apart: G = units·(ceil(Ψ/(units·bucket)) + 1)."""
    if psi < 1 or units < 1 or (bucket_elements is not None and bucket_elements < 1):
        raise ValueError(f"psi = {psi}, units = {units}, bucket_elements = {bucket_elements} is invalid; "
                         "psi and units >= 1, bucket_elements >= 1 or None")
    if bucket_elements is None:
        return 2, 2 * units
    return -(-psi // bucket_elements) + 1, units * (-(-psi // (units * bucket_elements)) + 1)


def dp_collectives(stage: int, mode: str, psi: int, dp: int, per_node: int, value_bytes: int = 2,
                   weight_bits: int = 8, grad_bits: int = 4, block: int = 256, scale_bytes: int = 4,
                   accumulation: int = 1, buckets: int = 1, gathers: int = 1,
                   pieces: Optional[Sequence[int]] = None, float8_elements: int = 0, float8_weights: int = 0,
                   float8_groups: int = 0) -> list:
    """The DP collectives one rank runs per step at ZeRO `stage` in `mode` (STAGE_MODES[stage]), with the
    bytes it sends on each link: Ψ = psi parameters (of this rank's TP slice, padded as the flat buffers
    are), N = dp ranks, m = per_node of them per node, k = N/m nodes, b = value_bytes (gradients and
    parameters travel in the model dtype), A = accumulation micro-batches, B = buckets collectives per
    bucketed pass, G = gathers per stage-3 gather pass (collectives_per_pass), q_w / q_g = quantized
    bytes per element (bits/8 + scale_bytes/block). Per rank per step:

    stage 0: the accumulated gradients all-reduced once per step: 2Ψb(N−1)/N in B calls of 2(N−1) steps.
    stage 1: once per step, a reduce-scatter of the accumulated gradients and an all-gather of the
    updated parameters: Ψb(N−1)/N each, B calls of N−1 steps each.
    stage 2: a reduce-scatter per micro-batch (AΨb(N−1)/N, A·B calls) and one all-gather (B calls).
    stage 3: per micro-batch a forward and a backward all-gather (A·G calls each) and a reduce-scatter
    (A·B calls), Ψb(N−1)/N each: per node 3AΨb(N−1)/N across nodes.
    A mode (+hpZ, +hybrid, +qwZ, +qgZ; qwZ+hpZ+qgZ: the three together) changes these as its card in
    analysis/modes.py says (q_w / q_g: its quantized bytes an element). `pieces`: the flat buffers' padded bucket
    sizes (each a multiple of N, summing to Ψ); given, every quantized chunk counts whole blocks, as the wire carries
    it (exact at any bucket size; without them Ψ·q, exact when every chunk is a whole number of blocks);
    B = len(pieces).
    zero.fp8_gather (stage 3, plain or +hybrid): `float8_elements` of Ψ (the FP8 linear weights' groups, padded) are
    gathered as float8 codes, one byte each instead of b, and before each gather every one of the `float8_groups`
    groups all-reduces its weights' amaxes: 2·4·float8_weights·(N−1)/N bytes per pass, 2(N−1) steps a group.

    A ring over N ranks in k > 1 node blocks crosses nodes on k of its N edges: a rank counts 1/m of what
    it sends as inter-node (link_collectives.ring_collective, comm.ring_link_split).
    """
    if stage not in STAGE_MODES or mode not in STAGE_MODES[stage]:
        valid = STAGE_MODES.get(stage, ())
        raise ValueError(f"mode {mode!r} is invalid at stage {stage}; valid: "
                         + (", ".join(repr(v) for v in valid) if valid else "stage 0-3"))
    if dp < 1 or per_node < 1 or dp % per_node:
        raise ValueError(f"dp = {dp} with {per_node} per node is invalid; dp must be a multiple of per_node >= 1")
    if min(accumulation, buckets, gathers) < 1:
        raise ValueError(f"accumulation = {accumulation}, buckets = {buckets}, gathers = {gathers} is invalid; "
                         "each must be >= 1")
    if pieces is not None and (sum(pieces) != psi or any(size % dp for size in pieces)):
        raise ValueError(f"pieces = {list(pieces)} is invalid; they must sum to psi = {psi}, each a multiple of "
                         f"dp = {dp}")
    if pieces is not None:
        buckets = len(pieces)
    n, m, k, a = dp, per_node, dp // per_node, accumulation
    full = Fraction(psi * value_bytes)
    modes = named_modes(mode)
    if float8_elements and (stage != 3 or modes.gathers_own_format):
        raise ValueError(f"{FLOAT8_REFUSED}; got stage {stage}, mode {mode!r}")
    cards = mode_costs(modes)
    for card in cards:
        n = card.shard_ranks(n, m)
    ring = Fraction(n - 1, n)
    where = "".join(card.where() for card in cards)
    p = DPPass(psi, pieces, n, m, k, a, buckets, gathers, full, ring, weight_bits, grad_bits, block, scale_bytes)
    grad_rs = [ring_collective("reduce_scatter" + where, full * ring * (a if stage >= 2 else 1), n, m,
                               buckets * (a if stage >= 2 else 1), "grads")]
    for card in cards:
        grad_rs = card.grad_reduction(p, grad_rs)
    if stage == 0:
        out = [ring_collective("all_reduce", 2 * full * ring, n, m, buckets, "grads", 2 * (n - 1))]
    elif stage in (1, 2):
        out = grad_rs + [ring_collective("all_gather" + where, full * ring, n, m, buckets, "params")]
    else:
        gathered = full - float8_elements * (value_bytes - 1)  # float8 codes: one byte an element
        gather, tag = gathered * ring, where
        for card in cards:
            gather, tag = card.gather(p, gather, tag)
        out = [ring_collective("all_gather fwd" + tag, gather * a, n, m, a * gathers, "params")]
        if float8_elements:  # each float8 group's amaxes, max-reduced before its forward and backward gathers
            out.append(ring_collective("all_reduce (fp8 amax)" + where, 2 * 2 * Fraction(4 * float8_weights) * ring * a,
                                       n, m, 2 * a * float8_groups, "params", 2 * (n - 1)))
        backward = ring_collective("all_gather bwd" + tag, gather * a, n, m, a * gathers, "params")
        for card in cards:
            backward = card.backward_gather(p, backward)
        out += [backward] + grad_rs
    for card in cards:
        out += card.after(p)
    return out


def zeropp_collectives(mode: str, psi: int, dp: int, per_node: int, **kwargs) -> list:
    """Stage 3's collectives in a --zeropp report row (ZEROPP_MODES: "stage 3" is plain): dp_collectives."""
    if mode not in ZEROPP_MODES:
        raise ValueError(f"mode {mode!r} is invalid; valid: {', '.join(ZEROPP_MODES)}")
    return dp_collectives(3, row_mode(mode), psi, dp, per_node, **kwargs)


def link_bytes(collectives: list) -> tuple[Fraction, Fraction]:
    """(intra-node, inter-node) bytes one rank sends over `collectives`."""
    return (sum((c.intra_bytes for c in collectives), Fraction(0)),
            sum((c.inter_bytes for c in collectives), Fraction(0)))


def link_seconds(c: LinkCollective, links: Links) -> float:
    """α-β time of one collective: α per ring step (InfiniBand's when it sends across nodes) plus the
    slower of its two links, which run at once: intra bytes at the GPU's NVSwitch bandwidth, inter
    bytes at the GPU's share of its node's InfiniBand (every GPU of a node runs its own DP group's
    collective at the same time)."""
    alpha = links.ib_latency if c.inter_bytes else links.nvswitch_latency
    return alpha * c.steps + max(float(c.intra_bytes) / links.nvswitch_bandwidth,
                                 float(c.inter_bytes) * links.gpus_per_node / links.ib_bandwidth_per_node)
