"""Process layout: torch.distributed from torchrun or Slurm, then megatron's TP × PP × DP groups."""
import contextlib
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

import megatron_patches
from pretrain.config import Config, ConfigError, validate_layout
from pretrain.errors import InputError
from pretrain.runtime.launch import expand_nodelist, host_line, launcher_env, node_name  # noqa: F401 - the launcher's view, re-exported


@dataclass
class Topology:
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
    # The DP group's nodes (zero3d/comm/topology.py), with intra-/inter-node groups only when a node-aware
    # zero.* mode is on; cluster.gpus_per_node places global rank g on node g // gpus_per_node.
    node: Optional[object] = None
    gpus_per_node: Optional[int] = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        """The pipeline stage that computes the loss (every rank when pp = 1)."""
        return self.pp_rank == self.pp - 1


def collective_timeout(cfg: Config) -> timedelta:
    """train.timeout_minutes, for the world group and every group megatron creates."""
    return timedelta(minutes=cfg.train.timeout_minutes)


def ranks_per_node(cfg: Config, env: Optional[dict] = None) -> int:
    """Ranks per node for the node-aware zero.* modes: cluster.gpus_per_node when the TOML or an override
    sets it (4 CPU ranks as 2 nodes × 2), else the launcher's count (zero3d.comm.topology), else a ConfigError."""
    from zero3d.comm.topology import TopologyError, resolve_gpus_per_node
    explicit = cfg.cluster.gpus_per_node if cfg.is_set("cluster.gpus_per_node") else None
    try:
        return resolve_gpus_per_node(explicit, os.environ if env is None else env)
    except TopologyError as err:
        raise ConfigError(str(err), "config", "set cluster.gpus_per_node (in the TOML or as an override "
                          "cluster.gpus_per_node=N) or launch with torchrun / srun, which state the ranks per node",
                          agreed=True) from None


def init_topology(cfg: Config, launch: Optional[dict] = None) -> Topology:
    """Validate the layout (before any collective), init the process group and megatron's groups,
    every one of them with the configured timeout."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    launch = launch or launcher_env()
    grad_accum = validate_layout(cfg, launch["world_size"])
    use_cuda = torch.cuda.is_available()
    if use_cuda and launch["local_rank"] >= torch.cuda.device_count():
        raise InputError(f"local rank {launch['local_rank']} has no GPU: {torch.cuda.device_count()} visible",
                         "environment", "start at most one rank per visible GPU (CUDA_VISIBLE_DEVICES)")
    device = torch.device("cuda", launch["local_rank"]) if use_cuda else torch.device("cpu")
    megatron_patches.apply(device.type)
    if use_cuda:
        torch.cuda.set_device(device)
    if launch["world_size"] > 1:
        print(host_line(launch), flush=True)  # every rank: where it runs, before the rendezvous waits on it
    os.environ.setdefault("MASTER_ADDR", launch["master_addr"])
    os.environ.setdefault("MASTER_PORT", launch["master_port"])
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=launch["rank"],
                                world_size=launch["world_size"],
                                timeout=collective_timeout(cfg))
    dist.distributed_c10d._get_default_store().set(f"{NODE_KEY}{launch['rank']}", node_name())  # for lost_peers
    # megatron converts with timedelta(minutes=...), so a fraction of a minute passes through.
    with contextlib.nullcontext() if use_cuda else megatron_patches.one_gloo_group_per_rank_set():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.parallel.tensor,
                                                 pipeline_model_parallel_size=cfg.parallel.pipeline,
                                                 distributed_timeout_minutes=cfg.train.timeout_minutes,
                                                 create_gloo_process_groups=False)
    # megatron seeds only the CUDA generators: the CPU one is seeded here, identically on every rank.
    torch.manual_seed(cfg.train.seed)
    model_parallel_cuda_manual_seed(cfg.train.seed)
    ps = parallel_state
    node = None
    if cfg.zero.node_aware():  # every rank builds the same sub-groups, in one agreed order
        from zero3d.comm.topology import TopologyError, build_node_topology
        try:
            node = build_node_topology(ps.get_data_parallel_group(), gpus_per_node=ranks_per_node(cfg),
                                       timeout=collective_timeout(cfg))
        except TopologyError as err:
            raise ConfigError(str(err), "config", "set cluster.gpus_per_node to the ranks each node runs",
                              agreed=True) from None
        problem = cfg.zero.node_layout_error(node.per_node, node.gpus_per_node)
        if problem:  # the same on every rank (every DP group has the same ranks per node)
            raise ConfigError(problem, "config", agreed=True)
    return Topology(node=node, gpus_per_node=node.gpus_per_node if node else cfg.cluster.gpus_per_node,
                    rank=launch["rank"], world_size=launch["world_size"], local_rank=launch["local_rank"],
                    tp=cfg.parallel.tensor, pp=cfg.parallel.pipeline, dp=ps.get_data_parallel_world_size(),
                    tp_rank=ps.get_tensor_model_parallel_rank(),
                    pp_rank=ps.get_pipeline_model_parallel_rank(),
                    dp_rank=ps.get_data_parallel_rank(), grad_accum=grad_accum, device=device,
                    dp_group=ps.get_data_parallel_group(), tp_group=ps.get_tensor_model_parallel_group(),
                    pp_group=ps.get_pipeline_model_parallel_group())


NODE_KEY, ALIVE_KEY = "zero3d/node/", "zero3d/alive/"
LOST_PEER_WAIT_S = 3.0


def lost_peers(wait_s: float = LOST_PEER_WAIT_S) -> str:
    """After a collective lost a peer: the ranks that do not answer on the rendezvous store within wait_s,
    with their nodes ("ranks 2, 3 on z3node2"); "" when every rank answers or the store is gone too (it
    lives in rank 0). Each failing rank marks itself alive, waits, then reads who did."""
    try:
        store = dist.distributed_c10d._get_default_store()
        world = dist.get_world_size()
        store.set(f"{ALIVE_KEY}{dist.get_rank()}", "1")
        time.sleep(wait_s)
        missing = [r for r in range(world) if not store.check([f"{ALIVE_KEY}{r}"])]
        nodes = {r: store.get(f"{NODE_KEY}{r}").decode() for r in missing}
    except Exception:  # noqa: BLE001 - a store that is gone names nothing; the error itself is reported
        return ""
    by_node = {}
    for r, node in nodes.items():
        by_node.setdefault(node, []).append(str(r))
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(rs)} on {node}" for node, rs in by_node.items())


def destroy_model_parallel_groups() -> None:
    """megatron's groups ended, the world group kept: for a process that builds another layout next."""
    megatron_patches.destroy_megatron_groups()


def destroy_topology() -> None:
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def layout_text(layout: dict) -> str:
    """A checkpoint's or run's layout signature (pretrain.train.layout_signature) in words."""
    return " × ".join(f"{k} {layout.get(k)}" for k in ("tensor", "pipeline", "data")) + f", stage {layout.get('stage')}"
