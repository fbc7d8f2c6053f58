"""Process layout: the validated Layout (degrees, ranks, groups, node topology) and its one builder, on any backend;
the engine's groups (ParallelGroups) are the layout's."""
import contextlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

import megatron_patches
from pretrain.config import Config, ConfigError, validate_layout
from pretrain.errors import InputError
from pretrain.runtime.rendezvous import NodeSizeError, host_line, launcher_env, node_name, resolve_gpus_per_node
from pretrain.runtime.rendezvous import expand_nodelist  # noqa: F401 - the launcher's view, re-exported
from zero3d.comm.gloo import lower_gloo_poller_priority


class LayoutError(ValueError):
    """A layout whose degrees, ranks or sizes do not fit together."""


def check_rank(name: str, value, size_name: str, size: int) -> None:
    """`value` is a rank inside its degree `size`: 0 .. size - 1."""
    if type(value) is not int or not 0 <= value < size:
        raise LayoutError(f"{name} = {value!r} is invalid; valid: 0 .. {size - 1} ({size_name} = {size})")


@dataclass
class Layout:
    """This rank's place in the job: world and degrees, its rank in each, megatron's groups, the DP group's
    node topology and the ranks per node, every one resolved once and checked together on construction."""
    rank: int
    world_size: int
    local_rank: int
    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    grad_accum: int
    device: torch.device
    dp_group: object
    tp_group: object
    pp_group: object
    # Global rank g is on node g // gpus_per_node: the node-aware zero.* modes' launcher count or
    # cluster.gpus_per_node (layout_gpus_per_node); every consumer (the engine's Comm too) takes it from here.
    gpus_per_node: int
    # The DP group's nodes (zero3d/comm/topology.py), with intra-/inter-node groups, only when a node-aware
    # zero.* mode is on.
    node: Optional[object] = None
    # Context parallelism: the ranks that split one sequence (parallel.context) and this rank's place among them.
    cp: int = 1
    cp_rank: int = 0
    cp_group: object = None
    # The ranks ZeRO shards over and averages gradients across: data × context (megatron's data-parallel group
    # with context parallelism); None: the DP group.
    zero_group: object = None
    # megatron's embedding group: the first and last pipeline stages, whose tied word embeddings sum their gradients
    # (None on the stages between them).
    embedding_group: object = None

    def __post_init__(self):
        for name in ("world_size", "tp", "pp", "dp", "cp", "grad_accum", "gpus_per_node"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise LayoutError(f"{name} = {value!r} is invalid; valid: an integer >= 1")
        if self.tp * self.pp * self.cp * self.dp != self.world_size:
            raise LayoutError(f"tp × pp × cp × dp = {self.tp} × {self.pp} × {self.cp} × {self.dp} is invalid for "
                              f"world_size = {self.world_size}; valid: degrees whose product is {self.world_size}")
        for name, size_name in (("rank", "world_size"), ("tp_rank", "tp"), ("pp_rank", "pp"), ("dp_rank", "dp"),
                                ("cp_rank", "cp")):
            check_rank(name, getattr(self, name), size_name, getattr(self, size_name))
        if type(self.local_rank) is not int or self.local_rank < 0:
            raise LayoutError(f"local_rank = {self.local_rank!r} is invalid; valid: an integer >= 0")
        if self.node is not None and (self.node.dp_size, self.node.gpus_per_node) != (self.dp, self.gpus_per_node):
            raise LayoutError(f"the node topology's dp_size = {self.node.dp_size}, gpus_per_node = "
                              f"{self.node.gpus_per_node} are invalid; valid: the layout's dp = {self.dp}, "
                              f"gpus_per_node = {self.gpus_per_node}")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_per_node(self) -> int:
        """The DP ranks on each node, as the node topology holds them (1 without a node-aware zero.* mode)."""
        return self.node.per_node if self.node is not None else 1

    @property
    def is_last_stage(self) -> bool:
        """The pipeline stage that computes the loss (every rank when pp = 1)."""
        return self.pp_rank == self.pp - 1

    def engine_groups(self, tied: Optional[dict] = None, norm_excluded: frozenset = frozenset()):
        """The engine's process groups (zero3d.ParallelGroups), this layout's: ZeRO over data × context, the TP group
        (an optimizer that takes matrices whole, Muon, joins their TP shards over it), the node topology and the ranks
        per node; `tied`: weights whose gradient is summed over another group of this layout before the DP reduction,
        `norm_excluded` the copies already counted in the norm (the model wing's tied_gradients)."""
        import zero3d
        return zero3d.ParallelGroups(dp_group=self.zero_group or self.dp_group, tp_rank=self.tp_rank,
                                     tp_group=self.tp_group, tied=dict(tied or {}), norm_excluded=norm_excluded,
                                     node_topology=self.node, gpus_per_node=self.gpus_per_node)


def collective_timeout(cfg: Config) -> timedelta:
    """train.timeout_minutes, for the world group and every group megatron creates."""
    return timedelta(minutes=cfg.train.timeout_minutes)


def ranks_per_node(cfg: Config, env: Optional[dict] = None) -> int:
    """Ranks per node for the node-aware zero.* modes: cluster.gpus_per_node when the TOML or an override
    sets it (4 CPU ranks as 2 nodes × 2), else the launcher's count in `env` (default: this process's
    environment; pretrain.runtime.rendezvous), else a ConfigError."""
    explicit = cfg.cluster.gpus_per_node if cfg.is_set("cluster.gpus_per_node") else None
    try:
        return resolve_gpus_per_node(explicit, env)
    except NodeSizeError as err:
        raise ConfigError(str(err), "config", "set cluster.gpus_per_node (in the TOML or as an override "
                          "cluster.gpus_per_node=N) or launch with torchrun / srun, which state the ranks per node",
                          agreed=True) from None


def layout_gpus_per_node(cfg: Config, launch: dict) -> int:
    """The ranks per node, resolved once for the Layout: the node-aware zero.* modes' ranks_per_node (from the
    launch's `env`, the launcher's variables, when it carries one), else cluster.gpus_per_node."""
    return ranks_per_node(cfg, launch.get("env")) if cfg.zero.node_aware() else cfg.cluster.gpus_per_node


def launched_device(launch: dict) -> torch.device:
    """The launcher's local GPU of this rank when CUDA is available, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if launch["local_rank"] >= torch.cuda.device_count():
        raise InputError(f"local rank {launch['local_rank']} has no GPU: {torch.cuda.device_count()} visible",
                         "environment", "start at most one rank per visible GPU (CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", launch["local_rank"])


def start_launched(launch: dict, device: torch.device, timeout: timedelta) -> None:
    """torch.distributed over the launcher's rendezvous (NCCL on GPUs, gloo on CPUs); kept if already up."""
    if launch["world_size"] > 1:
        print(host_line(launch), flush=True)  # every rank: where it runs, before the rendezvous waits on it
    os.environ.setdefault("MASTER_ADDR", launch["master_addr"])
    os.environ.setdefault("MASTER_PORT", launch["master_port"])
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=launch["rank"],
                                world_size=launch["world_size"], timeout=timeout)
    dist.distributed_c10d._get_default_store().set(f"{NODE_KEY}{launch['rank']}", node_name())  # for lost_peers


def start_fake(launch: dict, device: torch.device, timeout: timedelta) -> None:
    """torch.distributed on torch's `fake` backend (the probe): rank `launch["rank"]` of a world that
    need not exist; its collectives return at once and move nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("the probe needs a process without torch.distributed initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=launch["rank"], world_size=launch["world_size"],
                            timeout=timeout)


Start = Callable[[dict, torch.device, timedelta], None]


def init_layout(cfg: Config, launch: Optional[dict] = None, device: Optional[torch.device] = None,
                start: Start = start_launched) -> Layout:
    """Validate the layout (before any collective), init the process group (`start`: the launcher's, or
    start_fake for the probe) and megatron's groups, every one of them with the configured timeout, and
    the DP group's node topology; `device`: default the launcher's local GPU (launched_device)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    launch = launch or launcher_env()
    grad_accum = validate_layout(cfg, launch["world_size"])
    check_rank("rank", launch["rank"], "world_size", launch["world_size"])
    device = device or launched_device(launch)
    megatron_patches.apply(device.type)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    start(launch, device, collective_timeout(cfg))
    # megatron converts with timedelta(minutes=...), so a fraction of a minute passes through.
    with megatron_patches.one_gloo_group_per_rank_set() if dist.get_backend() == "gloo" else contextlib.nullcontext():
        ps.initialize_model_parallel(tensor_model_parallel_size=cfg.parallel.tensor,
                                     pipeline_model_parallel_size=cfg.parallel.pipeline,
                                     context_parallel_size=cfg.parallel.context,
                                     distributed_timeout_minutes=cfg.train.timeout_minutes,
                                     create_gloo_process_groups=False)
    # megatron seeds only the CUDA generators: the CPU one is seeded here, identically on every rank.
    torch.manual_seed(cfg.train.seed)
    model_parallel_cuda_manual_seed(cfg.train.seed)
    gpus_per_node = layout_gpus_per_node(cfg, launch)
    node = node_topology(cfg, launch["world_size"], gpus_per_node) if cfg.zero.node_aware() else None
    if dist.get_backend() == "gloo":
        # gloo's connectFullMesh returns on a rank once its own side of each pair is up: a rank that went on to end
        # its groups (a layout rebuilt) closed sockets a slower peer was still handshaking on ("Connection closed
        # by peer", once in CI). Past this barrier every rank has built every group.
        dist.barrier()
        lower_gloo_poller_priority()  # after every group this layout built
    return Layout(node=node, gpus_per_node=gpus_per_node,
                  rank=launch["rank"], world_size=launch["world_size"], local_rank=launch["local_rank"],
                  tp=cfg.parallel.tensor, pp=cfg.parallel.pipeline, dp=ps.get_data_parallel_world_size(),
                  tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                  dp_rank=ps.get_data_parallel_rank(), grad_accum=grad_accum, device=device,
                  dp_group=ps.get_data_parallel_group(), tp_group=ps.get_tensor_model_parallel_group(),
                  pp_group=ps.get_pipeline_model_parallel_group(), cp=cfg.parallel.context,
                  cp_rank=ps.get_context_parallel_rank(), cp_group=ps.get_context_parallel_group(),
                  zero_group=ps.get_data_parallel_group(with_context_parallel=True),
                  embedding_group=ps.get_embedding_group(check_initialized=False))


def node_topology(cfg: Config, world_size: int, gpus_per_node: int):
    """The DP group's NodeTopology with its sub-groups: every rank builds the same ones, in one agreed order,
    from every DP group's ranks (dp_groups); a layout that does not split into nodes is refused on every rank."""
    from megatron.core import parallel_state as ps
    from zero3d.comm.topology import TopologyError, build_node_topology, dp_groups
    try:
        node = build_node_topology(ps.get_data_parallel_group(), gpus_per_node, timeout=collective_timeout(cfg),
                                   dp_groups=dp_groups(world_size, cfg.parallel.tensor, cfg.parallel.pipeline))
    except TopologyError as err:
        raise ConfigError(str(err), "config", "set cluster.gpus_per_node to the ranks each node runs",
                          agreed=True) from None
    problem = cfg.zero.node_layout_error(node.per_node, node.gpus_per_node)
    if problem:  # the same on every rank (every DP group has the same ranks per node)
        raise ConfigError(problem, "config", agreed=True)
    return node


NODE_KEY, ALIVE_KEY = "zero3d/node/", "zero3d/alive/"
LOST_PEER_SETTLE_S = 3.0  # the survivors that failed at the same moment mark themselves meanwhile


def lost_peers(settle_s: float = LOST_PEER_SETTLE_S) -> str:
    """After a collective lost a peer: the ranks that do not answer on the rendezvous store, with their nodes ("ranks
    2, 3 on z3node2"); "" when every rank answers or the store is gone too (it lives in rank 0). Each failing rank
    marks itself alive and reads who did after settle_s. With a node wholly silent, only its ranks are named: a rank
    still silent on a node that answered is a survivor blocked in a collective until train.timeout_minutes (the 2-node
    Slurm test once named rank 0 so beside node 2's ranks, after a 10-s wait that this rule replaces)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        world = dist.get_world_size()
        store.set(f"{ALIVE_KEY}{dist.get_rank()}", "1")
        node_of = {r: store.get(f"{NODE_KEY}{r}").decode() for r in range(world)}
        time.sleep(settle_s)
        missing = [r for r in range(world) if not store.check([f"{ALIVE_KEY}{r}"])]
    except Exception:  # noqa: BLE001 - a store that is gone names nothing; the error itself is reported
        return ""
    silent = {node_of[r] for r in missing} - {node_of[r] for r in range(world) if r not in missing}
    if silent:
        missing = [r for r in missing if node_of[r] in silent]
    by_node = {}
    for r in missing:
        by_node.setdefault(node_of[r], []).append(str(r))
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(rs)} on {node}" for node, rs in by_node.items())


def destroy_model_parallel_groups() -> None:
    """megatron's groups ended, the world group kept: for a process that builds another layout next."""
    megatron_patches.destroy_megatron_groups()


def destroy_layout() -> None:
    """megatron's groups and the process group ended (init_layout undone)."""
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def layout_text(layout: dict) -> str:
    """A checkpoint's or run's layout signature (pretrain.checkpoint.checkpointer.layout_signature) in words."""
    keys = ("tensor", "pipeline", "data") + (("context",) if layout.get("context") not in (None, 1) else ())
    return " × ".join(f"{k} {layout.get(k)}" for k in keys) + f", stage {layout.get('stage')}"
