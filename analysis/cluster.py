"""The GPU cluster the planner, `--largest`, `--zeropp` and the α-β model describe: a GPU kind, nodes, links.

One home for the concept: `Cluster` (what the models read; its GPUs' kinds in analysis/gpus.py, their sustained
efficiency per kernel path in analysis/throughput.py),
`PRESETS` (DGX-2 V100, the paper's; DGX A100, H100, H200) and `ClusterSpec` (the user's description: a
preset, its node count and any overrides, from CLI flags or a `[cluster]` TOML section) → `Cluster`.
"""
import dataclasses
import tomllib
from dataclasses import dataclass
from typing import Optional

from analysis.comm_model import Links
from analysis.estimate import GIB
from analysis.gpus import A100, GPU_KINDS, H100, H200, V100, GPUKind
from analysis.throughput import MEASURED_ROWS, Efficiency, KernelPath, efficiency


@dataclass(frozen=True)
class Cluster:
    """A homogeneous GPU cluster as the models read it; bandwidths are per GPU unless named per node."""

    name: str  # printed in reports
    gpus_per_node: int
    nodes: int
    gpu_memory_bytes: float  # the budget per GPU (GiB as labelled, docs/estimator.md)
    intra_node_bandwidth: float  # bytes/s per GPU inside a node (NVSwitch / NVLink)
    inter_node_bandwidth: float  # bytes/s per NODE, shared by its GPUs (InfiniBand)
    peak_flops: float  # per GPU, dense, at the training precision
    pcie_bandwidth: float  # bytes/s per GPU between host and device
    gpu: str  # analysis.gpus.GPU_KINDS key: whose measured rows give the compute's share of peak (efficiency_along)
    host_memory_bytes: float  # per NODE, shared by its GPUs (ZeRO-Offload's host states)
    nvme_bytes: float  # per NODE (ZeRO-Infinity's files)
    intra_latency: float = 5e-6  # α, seconds per ring step inside a node (assumed; the paper states none)
    inter_latency: float = 10e-6  # α, seconds per ring step across nodes (assumed)
    fp32_flops: Optional[float] = None  # plain fp32 per GPU (Muon's Newton–Schulz runs in it); None: peak_flops
    fp8_peak_flops: Optional[float] = None  # per GPU, dense float8 (precision.fp8's GEMMs); None: no float8
    rows: tuple = MEASURED_ROWS  # the measured rows efficiency_along reads (a user's run: pretrain --plan --measured)

    def __post_init__(self):
        for name in ("gpus_per_node", "nodes", "gpu_memory_bytes", "intra_node_bandwidth", "inter_node_bandwidth",
                     "peak_flops", "pcie_bandwidth", "host_memory_bytes", "nvme_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cluster {name} = {getattr(self, name)} is invalid; must be > 0")
        if self.gpu not in GPU_KINDS:
            raise ValueError(f"cluster gpu = {self.gpu!r} is invalid; valid: {', '.join(GPU_KINDS)}")
        if self.intra_latency < 0 or self.inter_latency < 0:
            raise ValueError(f"cluster latencies {self.intra_latency}, {self.inter_latency} are invalid; must be >= 0")

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def efficiency_along(self, path: KernelPath) -> Efficiency:
        """The share of peak a step sustains along `path` on this cluster's GPUs, from the measured rows
        (analysis.throughput.efficiency): the compute's, with no communication exposed."""
        return efficiency(self.gpu, path, self.rows)

    @property
    def efficiency(self) -> float:
        """The share of peak along the paper's kernels (materialised attention, eager, no float8): the reports that
        model them (--zeropp, the predicted tables)."""
        return self.efficiency_along(KernelPath()).value

    @property
    def inter_node_bandwidth_per_gpu(self) -> float:
        return self.inter_node_bandwidth / self.gpus_per_node

    def holds_offload(self, o, gpus: int, margin_fraction: float) -> bool:
        """Do a node's GPUs' host and NVMe bytes (an OffloadBreakdown) fit its memory and disks, less the margin?"""
        on_node = min(gpus, self.gpus_per_node)
        return (o.host_bytes * on_node <= (1 - margin_fraction) * self.host_memory_bytes
                and o.nvme_bytes * on_node <= (1 - margin_fraction) * self.nvme_bytes)

    @property
    def links(self) -> Links:
        """comm_model's α-β link settings for this cluster."""
        return Links(gpus_per_node=self.gpus_per_node, nvswitch_bandwidth=self.intra_node_bandwidth,
                     nvswitch_latency=self.intra_latency, ib_bandwidth_per_node=self.inter_node_bandwidth,
                     ib_latency=self.inter_latency)



@dataclass(frozen=True)
class NodeKind:
    """A node preset: its GPUs and links (bandwidths in bytes/s), and how many nodes it has by default."""

    title: str  # printed as the cluster's name, with the node count
    gpu: GPUKind
    gpus_per_node: int
    nodes: int  # default node count
    intra_node_bandwidth: float  # per GPU
    inter_node_bandwidth: float  # per node
    pcie_bandwidth: float  # per GPU, one direction, nominal
    host_memory_bytes: float  # per node
    nvme_bytes: float  # per node


# Sources: the paper §4.1 (DGX-2); NVIDIA DGX A100 / DGX H100 / DGX H200 data sheets: NVLink 3 600 GB/s and
# NVLink 4 900 GB/s per GPU (the V100's NVSwitch 300 GB/s is quoted the same way), 8 × 200 Gb/s HDR and
# 8 × 400 Gb/s NDR ConnectX NICs per node for the compute fabric, PCIe 4.0 / 5.0 x16 (31.5 / 63 GB/s one
# direction), 2 TB of system memory, 8 × 3.84 TB NVMe data drives.
PRESETS = {
    "dgx2-v100": NodeKind("paper: {nodes} DGX-2 × 16 V100-SXM3-32GB", V100, 16, 25,
                          intra_node_bandwidth=300e9,  # NVSwitch, 300 GB/s per link (paper §4.1)
                          inter_node_bandwidth=8 * 100e9 / 8,  # 8 × 100 Gb/s InfiniBand EDR per node
                          pcie_bandwidth=15.75e9,  # PCIe 3.0 x16, one direction, nominal
                          host_memory_bytes=24 * 64 * GIB,  # 24 × 64 GB DDR4 DIMMs (labelled in GiB)
                          nvme_bytes=2 * 960e9),  # 2 × Samsung 960 GB NVMe SSDs (labelled in 10^9)
    "dgx-a100": NodeKind("{nodes} DGX A100 × 8 A100-SXM4-80GB", A100, 8, 4, 600e9, 8 * 200e9 / 8, 31.5e9,
                         2 * 2**40, 8 * 3.84e12),
    "dgx-h100": NodeKind("{nodes} DGX H100 × 8 H100-SXM5-80GB", H100, 8, 4, 900e9, 8 * 400e9 / 8, 63e9,
                         2 * 2**40, 8 * 3.84e12),
    "dgx-h200": NodeKind("{nodes} DGX H200 × 8 H200-SXM-141GB", H200, 8, 4, 900e9, 8 * 400e9 / 8, 63e9,
                         2 * 2**40, 8 * 3.84e12),
}
DEFAULT_PRESET = "dgx2-v100"


@dataclass(frozen=True)
class ClusterSpec:
    """The user's cluster: a preset and any overrides (CLI flags or a `[cluster]` TOML section, same names)."""

    preset: str = DEFAULT_PRESET  # a PRESETS key
    nodes: Optional[int] = None  # node count (default: the preset's)
    gpus_per_node: Optional[int] = None  # GPUs per node (default: the preset's)
    gpu_peak_tflops: Optional[float] = None  # dense TFLOP/s per GPU at the training precision
    gpu_memory_gb: Optional[float] = None  # memory per GPU, GiB as labelled
    intra_bw: Optional[float] = None  # GB/s per GPU inside a node
    inter_bw: Optional[float] = None  # GB/s per GPU across nodes (its share of the node's NICs)

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"cluster preset {self.preset!r} is invalid; valid: {', '.join(PRESETS)}")
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"cluster {name} = {value!r} is invalid; must be a positive integer")
        for name in ("gpu_peak_tflops", "gpu_memory_gb", "intra_bw", "inter_bw"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"cluster {name} = {value!r} is invalid; must be a number > 0")

    @property
    def gpu_memory_bytes(self) -> float:
        """The budget per GPU (needs no precision)."""
        return (self.gpu_memory_gb or PRESETS[self.preset].gpu.memory_gb) * GIB

    @property
    def custom(self) -> bool:
        """Does any override change the preset's GPUs or links?"""
        node = PRESETS[self.preset]
        preset = {"gpus_per_node": node.gpus_per_node, "gpu_memory_gb": node.gpu.memory_gb, "gpu_peak_tflops": None,
                  "intra_bw": node.intra_node_bandwidth / 1e9,
                  "inter_bw": node.inter_node_bandwidth / node.gpus_per_node / 1e9}
        return any(getattr(self, f) is not None and getattr(self, f) != value for f, value in preset.items())

    def cluster(self, precision: str = "fp16") -> Cluster:
        """The Cluster the models read, its peak at `precision`."""
        node = PRESETS[self.preset]
        nodes = self.nodes or node.nodes
        per_node = self.gpus_per_node or node.gpus_per_node
        peak = self.gpu_peak_tflops * 1e12 if self.gpu_peak_tflops else node.gpu.peak_flops(precision)
        memory = self.gpu_memory_bytes
        name = node.title.format(nodes=nodes)
        if self.custom:
            name += (f", custom: {per_node} GPUs per node, {peak / 1e12:g} TFLOP/s, {memory / GIB:g} GiB, "
                     f"{(self.intra_bw or node.intra_node_bandwidth / 1e9):g} / "
                     f"{(self.inter_bw or node.inter_node_bandwidth / node.gpus_per_node / 1e9):g} GB/s per GPU")
        inter = self.inter_bw * 1e9 * per_node if self.inter_bw else node.inter_node_bandwidth
        return Cluster(name=name, gpus_per_node=per_node, nodes=nodes, gpu_memory_bytes=memory,
                       intra_node_bandwidth=self.intra_bw * 1e9 if self.intra_bw else node.intra_node_bandwidth,
                       inter_node_bandwidth=inter, peak_flops=peak, pcie_bandwidth=node.pcie_bandwidth,
                       gpu=next(key for key, kind in GPU_KINDS.items() if kind is node.gpu), host_memory_bytes=node.host_memory_bytes, nvme_bytes=node.nvme_bytes,
                       fp32_flops=node.gpu.peak_flops("fp32"),
                       fp8_peak_flops=node.gpu.fp8_tflops * 1e12 if node.gpu.fp8_tflops else None)


# A run config's [cluster] (pretrain's ClusterConfig) reads as a ClusterSpec too: `gpu` names the preset
# (PRESET_OF_GPU) and the keys only Slurm needs are skipped
RUN_ONLY_KEYS = ("min_nodes", "time_limit", "partition", "checkpoint_write_gbps")


def spec_from_toml(path: str) -> ClusterSpec:
    """The `[cluster]` section of a TOML file as a ClusterSpec: ClusterSpec's keys, or a run config's [cluster]
    (`gpu` = V100 / A100 / H100 / H200 for the preset; its Slurm-only keys skipped)."""
    with open(path, "rb") as f:
        section = tomllib.load(f).get("cluster")
    keys = list(ClusterSpec.__dataclass_fields__)
    if not isinstance(section, dict):
        raise ValueError(f"{path} has no [cluster] section; keys: {', '.join(keys)}")
    section = {k: v for k, v in section.items() if k not in RUN_ONLY_KEYS}
    if "gpu" in section:
        gpu = section.pop("gpu")
        if gpu not in PRESET_OF_GPU:
            raise ValueError(f"[cluster] gpu = {gpu!r} in {path} is invalid; valid: {', '.join(PRESET_OF_GPU)}")
        if section.get("preset", PRESET_OF_GPU[gpu]) != PRESET_OF_GPU[gpu]:
            raise ValueError(f"[cluster] gpu = {gpu!r} disagrees with preset = {section['preset']!r} in {path}")
        section["preset"] = PRESET_OF_GPU[gpu]
    unknown = sorted(set(section) - set(keys))
    if unknown:
        raise ValueError(f"[cluster] key {unknown[0]!r} in {path} is invalid; valid: {', '.join(keys)}, gpu")
    return ClusterSpec(**section)


def with_overrides(spec: ClusterSpec, **overrides) -> ClusterSpec:
    """`spec` with the overrides that are not None (CLI flags over a TOML section)."""
    return dataclasses.replace(spec, **{k: v for k, v in overrides.items() if v is not None})


PAPER_CLUSTER = ClusterSpec().cluster("fp16")
# The node preset of each GPU_KINDS key (a run config's cluster.gpu): its links for the α-β model
PRESET_OF_GPU = {"V100": "dgx2-v100", "A100": "dgx-a100", "H100": "dgx-h100", "H200": "dgx-h200"}


def links_for_gpu(gpu_key: str, gpus_per_node: int) -> Links:
    """α-β links of `gpu_key`'s node preset (PRESET_OF_GPU) with `gpus_per_node` GPUs per node (a run
    config's cluster.gpu and cluster.gpus_per_node); ValueError naming the valid keys otherwise."""
    if gpu_key not in PRESET_OF_GPU:
        raise ValueError(f"cluster.gpu = {gpu_key!r} has no node preset for the α-β model; valid: "
                         f"{', '.join(PRESET_OF_GPU)}")
    return ClusterSpec(PRESET_OF_GPU[gpu_key], gpus_per_node=gpus_per_node).cluster("fp16").links


def add_cluster_flags(ap) -> None:
    """The CLI's cluster flags (an argparse parser): a preset or a [cluster] TOML file, and overrides."""
    g = ap.add_argument_group("cluster (docs/estimator.md, Cluster; default: the paper's 25 DGX-2 × 16 V100)")
    g.add_argument("--cluster", choices=list(PRESETS), help="node preset (default dgx2-v100)")
    g.add_argument("--cluster-file", metavar="TOML", help="a TOML file's [cluster] section (ClusterSpec's keys: "
                   "preset, nodes, gpus_per_node, gpu_peak_tflops, gpu_memory_gb, intra_bw, inter_bw); flags win")
    g.add_argument("--nodes", type=int, help="node count (default: the preset's: 25 DGX-2, 4 DGX A100/H100/H200)")
    g.add_argument("--gpus-per-node", type=int, help="custom: GPUs per node")
    g.add_argument("--gpu-peak-tflops", type=float, help="custom: dense TFLOP/s per GPU at --precision")
    g.add_argument("--gpu-memory-gb", type=float, help="GPU memory in GiB, as cards are labelled and as "
                   "cluster.gpu_memory_gb is read (docs/estimator.md, Budget); default: the preset's (32 on a V100)")
    g.add_argument("--intra-bw", type=float, help="custom: GB/s per GPU inside a node (NVLink / NVSwitch)")
    g.add_argument("--inter-bw", type=float, help="custom: GB/s per GPU across nodes (the node's NICs / its GPUs)")


def spec_from_args(args) -> ClusterSpec:
    """The ClusterSpec of parsed add_cluster_flags flags (ValueError naming a bad value)."""
    spec = spec_from_toml(args.cluster_file) if args.cluster_file else ClusterSpec()
    return with_overrides(spec, preset=args.cluster, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                          gpu_peak_tflops=args.gpu_peak_tflops, gpu_memory_gb=args.gpu_memory_gb,
                          intra_bw=args.intra_bw, inter_bw=args.inter_bw)


def described(args) -> bool:
    """Did the command line describe a cluster (any cluster flag), rather than take the paper's by default?"""
    return any(getattr(args, f) is not None for f in ("cluster", "cluster_file", "nodes", "gpus_per_node",
                                                      "gpu_peak_tflops", "intra_bw", "inter_bw"))
