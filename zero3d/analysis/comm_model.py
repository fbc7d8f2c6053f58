"""α-β model of collectives over a DGX-2-style cluster: NVSwitch inside a node, InfiniBand between nodes."""
from collections import defaultdict
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
