"""Process lookups for the local cluster's clean-up: /proc environments and ancestry, liveness (reaping our own children)."""
import os
from pathlib import Path


def environments():
    """(pid, environment) of every process we may read."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        yield int(entry.name), env


def parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def ancestors() -> set[int]:
    """This process and its parents: never killed by a clean-up, even when run inside one of the jobs."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        pid = parent(pid)
    return pids


def alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)  # reap our own child so it does not linger as a zombie
        if waited == pid:
            return False
    except ChildProcessError:
        pass  # not our child (started by an earlier `start` command): fall back to a signal probe
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
