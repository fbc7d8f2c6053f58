"""Process layout: torch.distributed from torchrun or Slurm, then megatron's TP × PP × DP groups."""
import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import megatron_patches
from pretrain.config import Config, validate_layout


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


def launcher_env() -> dict:
    """rank / world / local rank / master from torchrun, else Slurm's srun, else a single process."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return dict(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]),
                    local_rank=int(env.get("LOCAL_RANK", 0)),
                    master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=env.get("MASTER_PORT", "29500"))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodes = expand_nodelist(env.get("SLURM_STEP_NODELIST") or env["SLURM_NODELIST"])
        # A port derived from the job id, so concurrent jobs on one node do not collide.
        port = env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
        return dict(rank=int(env["SLURM_PROCID"]), world_size=int(env["SLURM_NTASKS"]),
                    local_rank=int(env.get("SLURM_LOCALID", 0)),
                    master_addr=env.get("MASTER_ADDR", nodes[0]), master_port=port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dict(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=str(port))


def init_topology(cfg: Config) -> Topology:
    """Validate the layout (before any collective), init the process group and megatron's groups."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    launch = launcher_env()
    grad_accum = validate_layout(cfg, launch["world_size"])
    use_cuda = torch.cuda.is_available()
    device = torch.device("cuda", launch["local_rank"]) if use_cuda else torch.device("cpu")
    megatron_patches.apply(device.type)
    if use_cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", launch["master_addr"])
    os.environ.setdefault("MASTER_PORT", launch["master_port"])
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=launch["rank"],
                                world_size=launch["world_size"],
                                timeout=timedelta(minutes=cfg.train.timeout_minutes))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=cfg.parallel.tensor,
                                             pipeline_model_parallel_size=cfg.parallel.pipeline)
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
