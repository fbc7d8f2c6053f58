"""Rank, world size and rendezvous address from torchrun, Slurm or a single process, checked (no torch here)."""
import os
import re
import socket
from typing import Mapping, Optional

from pretrain.errors import InputError


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


# Set differently on every rank: an error in one is that rank's alone, and it reports it itself.
PER_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_LOCALID")


def _env_int(name: str, default: Optional[str] = None, minimum: int = 0) -> int:
    raw = os.environ.get(name, default)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        value = None
    if value is None or value < minimum:
        raise InputError(f"{name}={raw!r} is not an integer >= {minimum}", "environment",
                         "launch with torchrun or srun, or set it to a valid number",
                         agreed=name not in PER_RANK_VARIABLES)
    return value


def check_launch(launch: dict) -> dict:
    """The launcher's rank / world / port / master make sense, before any rendezvous waits on them."""
    if not launch["rank"] < launch["world_size"]:
        raise InputError(f"rank {launch['rank']} is outside world size {launch['world_size']}", "environment",
                         "RANK (SLURM_PROCID) must be below WORLD_SIZE (SLURM_NTASKS)", agreed=False)
    port = launch["master_port"]
    if not (port.isdigit() and 1 <= int(port) <= 65535):
        raise InputError(f"MASTER_PORT={port!r} is not a port number", "environment",
                         "set MASTER_PORT to an integer in 1..65535 (or leave it to the launcher)")
    return launch


def check_master_resolves(launch: dict) -> None:
    """A master host name that does not resolve would leave every rank waiting at the rendezvous."""
    if launch["world_size"] > 1:
        try:
            socket.getaddrinfo(launch["master_addr"], int(launch["master_port"]))
        except (socket.gaierror, UnicodeError) as err:
            raise InputError(f"MASTER_ADDR={launch['master_addr']!r} does not resolve ({err})", "environment",
                             "set MASTER_ADDR to the first node's host name or address") from None


def env_rank() -> Optional[int]:
    """This process's rank as the launcher set it, unchecked (None where it is not a number): for the
    start-up and error paths that run before launcher_env() has validated the launch."""
    raw = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    return int(raw) if raw.isdigit() else None


def env_world_size() -> int:
    """The world size as the launcher set it, unchecked (0 where it is not a number)."""
    raw = os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))
    return int(raw) if raw.isdigit() else 0


def free_port(host: str = "127.0.0.1") -> int:
    """A free port in 20000-32767, below Linux's ephemeral range (32768-60999), from which gloo's and NCCL's
    connections (and every other outgoing socket) take theirs: a port the kernel hands out for binding to 0
    could be taken by one of those before the rendezvous binds it (EADDRINUSE)."""
    import random
    for _ in range(200):
        port = random.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise InputError("no free port in 20000-32767 for the rendezvous", "environment", "set MASTER_PORT")


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
        # Below Linux's ephemeral range (32768-60999), so a connecting socket cannot already hold it.
        port = env.get("MASTER_PORT") or str(20000 + _env_int("SLURM_JOB_ID", "0") % 10000)
        return check_launch(dict(
            rank=_env_int("SLURM_PROCID"), world_size=_env_int("SLURM_NTASKS", minimum=1),
            local_rank=_env_int("SLURM_LOCALID", "0"), master_addr=env.get("MASTER_ADDR", nodes[0]),
            master_port=port))
    return dict(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=str(free_port()))


class NodeSizeError(ValueError):
    """The ranks per node are unknown, unreadable in the launcher's variables, or invalid."""


def launcher_gpus_per_node(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Ranks per node as the launcher states it in `env` (default: this process's environment):
    SLURM_NTASKS_PER_NODE, else SLURM_TASKS_PER_NODE ("8(x4)" or "8,8"; uneven counts are refused), else
    torchrun's LOCAL_WORLD_SIZE; None if none is set."""
    env = os.environ if env is None else env
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "LOCAL_WORLD_SIZE"):
        value = env.get(name, "").strip()
        if not value:
            continue
        counts = set()
        for part in value.split(","):
            m = re.fullmatch(r"(\d+)(?:\(x\d+\))?", part.strip())
            if not m:
                raise NodeSizeError(f"{name} = {value!r} is invalid; expected counts like '8', '8(x4)' or '8,8'")
            counts.add(int(m.group(1)))
        if len(counts) != 1 or min(counts) < 1:
            raise NodeSizeError(f"{name} = {value!r}: nodes run different numbers of ranks; "
                                "zero3d needs the same count on every node (or give gpus_per_node)")
        return counts.pop()
    return None


def resolve_gpus_per_node(gpus_per_node: Optional[int] = None, env: Optional[Mapping[str, str]] = None) -> int:
    """The explicit `gpus_per_node` wins (4 CPU ranks as 2 nodes × 2); else the launcher's count in `env`."""
    if gpus_per_node is not None:
        if type(gpus_per_node) is not int or gpus_per_node < 1:
            raise NodeSizeError(f"gpus_per_node = {gpus_per_node!r} is invalid; must be an integer >= 1")
        return gpus_per_node
    found = launcher_gpus_per_node(env)
    if found is None:
        raise NodeSizeError("ranks per node unknown: none of SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE, "
                            "LOCAL_WORLD_SIZE is set; give gpus_per_node")
    return found


def node_name() -> str:
    """This rank's node: Slurm's name for it (SLURMD_NODENAME), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def host_line(launch: dict) -> str:
    """One line per rank naming where it runs: rank, host, Slurm node (SLURMD_NODENAME; the host outside
    Slurm), local rank, and the rendezvous it joins."""
    host = socket.gethostname()
    node = node_name()
    return (f"rank {launch['rank']}/{launch['world_size']}: host {host}, node {node}, local rank "
            f"{launch['local_rank']}, master {launch['master_addr']}:{launch['master_port']}")

