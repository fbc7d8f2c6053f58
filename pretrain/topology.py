"""Process layout: torch.distributed from torchrun or Slurm, then megatron's TP × PP × DP groups."""
import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

import megatron_patches
from pretrain.config import Config, validate_layout
from pretrain.errors import InputError


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

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        """The pipeline stage that computes the loss (every rank when pp = 1)."""
        return self.pp_rank == self.pp - 1


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list ("gpu[01-03,07],login1") → host names, in order."""
    hosts = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", nodelist):
        m = re.fullmatch(r"(.*)\[(.*)\]", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}")
    return hosts


def _env_int(name: str, default: Optional[str] = None, minimum: int = 0) -> int:
    raw = os.environ.get(name, default)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = None
    if value is None or value < minimum:
        raise InputError(f"{name}={raw!r} is not an integer >= {minimum}", "environment",
                         "launch with torchrun or srun, or set it to a valid number")
    return value


def check_launch(launch: dict) -> dict:
    """The launcher's rank / world / port / master make sense, before any rendezvous waits on them."""
    if not launch["rank"] < launch["world_size"]:
        raise InputError(f"rank {launch['rank']} is outside world size {launch['world_size']}", "environment",
                         "RANK (SLURM_PROCID) must be below WORLD_SIZE (SLURM_NTASKS)")
    port = launch["master_port"]
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise InputError(f"MASTER_PORT={port!r} is not a port number", "environment",
                         "set MASTER_PORT to an integer in 1..65535 (or leave it to the launcher)")
    if launch["world_size"] > 1:
        try:
            socket.getaddrinfo(launch["master_addr"], int(port))
        except (socket.gaierror, UnicodeError) as err:
            raise InputError(f"MASTER_ADDR={launch['master_addr']!r} does not resolve ({err})", "environment",
                             "set MASTER_ADDR to the first node's host name or address") from None
    return launch


def launcher_env() -> dict:
    """rank / world / local rank / master from torchrun, else Slurm's srun, else a single process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return check_launch(dict(
            rank=_env_int("RANK"), world_size=_env_int("WORLD_SIZE", minimum=1),
            local_rank=_env_int("LOCAL_RANK", "0"), master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=env.get("MASTER_PORT", "29500")))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST", "127.0.0.1"))
        # A port derived from the job id, so concurrent jobs on one node do not collide.
        port = env.get("MASTER_PORT") or str(20000 + _env_int("SLURM_JOB_ID", "0") % 20000)
        return check_launch(dict(
            rank=_env_int("SLURM_PROCID"), world_size=_env_int("SLURM_NTASKS", minimum=1),
            local_rank=_env_int("SLURM_LOCALID", "0"), master_addr=env.get("MASTER_ADDR", nodes[0]),
            master_port=port))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dict(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=str(port))


def collective_timeout(cfg: Config) -> timedelta:
    """train.timeout_minutes, for the world group and every group megatron creates."""
    return timedelta(minutes=cfg.train.timeout_minutes)


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
    os.environ.setdefault("MASTER_ADDR", launch["master_addr"])
    os.environ.setdefault("MASTER_PORT", launch["master_port"])
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=launch["rank"],
                                world_size=launch["world_size"],
                                timeout=collective_timeout(cfg))
    # megatron converts with timedelta(minutes=...), so a fraction of a minute passes through.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.parallel.tensor,
                                             pipeline_model_parallel_size=cfg.parallel.pipeline,
                                             distributed_timeout_minutes=cfg.train.timeout_minutes)
    # megatron seeds only the CUDA generators: the CPU one is seeded here, identically on every rank.
    torch.manual_seed(cfg.train.seed)
    model_parallel_cuda_manual_seed(cfg.train.seed)
    ps = parallel_state
    return Topology(rank=launch["rank"], world_size=launch["world_size"], local_rank=launch["local_rank"],
                    tp=cfg.parallel.tensor, pp=cfg.parallel.pipeline, dp=ps.get_data_parallel_world_size(),
                    tp_rank=ps.get_tensor_model_parallel_rank(),
                    pp_rank=ps.get_pipeline_model_parallel_rank(),
                    dp_rank=ps.get_data_parallel_rank(), grad_accum=grad_accum, device=device,
                    dp_group=ps.get_data_parallel_group(), tp_group=ps.get_tensor_model_parallel_group(),
                    pp_group=ps.get_pipeline_model_parallel_group())


def destroy_topology() -> None:
    from megatron.core import parallel_state
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
