"""<run_dir>/run.lock: one job at a time writes a run directory.

Rank 0 takes the lock before the first write of a start (the repair of an interrupted save; the run's records come
later, once every check has passed: pretrain/runtime/lifecycle.py's `start_run`) and releases it on every way out of
the process it can see (a return, an error, the watchdog's and a second SIGINT's immediate exits). The file names
its holder: host, pid and the process's start time, and under Slurm the job id, restart count, name and user.

A lock left by a process that cannot release it (kill -9, a lost node) is stale, and taken over with one line, only
when that is certain: its process is gone from this host (no such pid, or a pid reused by a later process), or it
was an earlier allocation of this same Slurm job (a requeue: Slurm ends every step of the one before), or it was an
earlier job of this run directory's name while this job waits for such jobs (slurm/submit.py's
`--dependency=singleton`, which Slurm starts only once every earlier job of that name and user has ended). Any
other holder is taken to be alive: the start is refused in one line naming it and how to remove the lock. No torch
here: the lock is plain files, created whole (a temporary file linked into place, which fails if one is there).
"""
import getpass
import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Optional

import psutil

from pretrain.atomic import temporary_name
from pretrain.errors import InputError

LOCK_FILE = "run.lock"
SINGLETON_VARIABLE = "ZERO3D_SINGLETON"  # slurm/submit.py sets it with --dependency=singleton
_held: dict = {}  # this process's lock: {"path", "token", "created"} while held


def _started(pid: int) -> Optional[float]:
    """The start time of process `pid` on this host, None when there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:  # another user's live process
        return -1.0


def _user() -> str:
    """This process's user name (its uid where the system has no name for it, as in some containers)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def holder_record(environ=os.environ) -> dict:
    """What the lock says of this process."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": _started(os.getpid()),
            "job_id": environ.get("SLURM_JOB_ID"), "restart": int(environ.get("SLURM_RESTART_COUNT", 0) or 0),
            "job_name": environ.get("SLURM_JOB_NAME"), "user": _user(), "since": time.time(),
            "token": uuid.uuid4().hex}


def holder_text(holder: dict) -> str:
    job = f", Slurm job {holder['job_id']}" if holder.get("job_id") else ""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"])) if holder.get("since") else "?"
    return f"pid {holder.get('pid')} on host {holder.get('host')}{job}, since {since}"


def stale_reason(holder: dict, environ=os.environ) -> Optional[str]:
    """Why the holder cannot be writing any more, or None when it may be (module docstring)."""
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        started = _started(holder["pid"])
        if started is None:
            return "its process is gone"
        if started != -1.0 and holder.get("pid_started") is not None and abs(started - holder["pid_started"]) > 1e-3:
            return "its pid now belongs to a later process"
    job, ours = holder.get("job_id"), environ.get("SLURM_JOB_ID")
    if job and ours and job == ours and int(holder.get("restart") or 0) < int(environ.get("SLURM_RESTART_COUNT", 0) or 0):
        return f"it was an earlier allocation of this job (restart {holder.get('restart')}), which Slurm ended"
    if (job and ours and environ.get(SINGLETON_VARIABLE) == "1" and holder.get("job_name") == environ.get("SLURM_JOB_NAME")
            and holder.get("user") == _user() and job.isdigit() and ours.isdigit() and int(job) < int(ours)):
        return (f"Slurm job {job} of this run directory's name ended before this one started "
                "(--dependency=singleton)")
    return None


def _read(path: Path) -> Optional[dict]:
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise InputError(f"{path} cannot be read as a run lock ({err})", "run directory lock",
                         f"if no job is writing {path.parent}, remove {path}") from None
    return record if isinstance(record, dict) else {}


def refusal(path: Path, holder: dict) -> InputError:
    return InputError(f"run directory {path.parent} is in use: {path.name} is held by {holder_text(holder)}",
                      "run directory lock", f"wait for that run to end; if it is gone (a lost node), remove {path}")


def check_free(run_dir: Path, environ=os.environ) -> None:
    """Read only: refuse a run directory whose lock a live job holds (before any expensive start-up work)."""
    path = Path(run_dir) / LOCK_FILE
    holder = _read(path)
    if holder is not None and holder.get("token") != _held.get("token") and stale_reason(holder, environ) is None:
        raise refusal(path, holder)


def acquire(run_dir: Path, environ=os.environ) -> list[str]:
    """Take the lock (InputError naming a live holder); returns the lines saying a stale lock was taken over."""
    run_dir = Path(run_dir)
    created = []
    for directory in [run_dir, *run_dir.parents]:  # what this start creates, removed again on release if empty
        if directory.exists():
            break
        created.append(directory)
    run_dir.mkdir(parents=True, exist_ok=True)
    path, record, lines = run_dir / LOCK_FILE, holder_record(environ), []
    tmp = temporary_name(path)
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    try:
        for _ in range(3):
            try:
                os.link(tmp, path)  # created whole, or not at all when another holds it
            except FileExistsError:
                holder = _read(path)
                if holder is None:  # released meanwhile: try again
                    continue
                why = stale_reason(holder, environ)
                if why is None:
                    raise refusal(path, holder) from None
                aside = path.with_name(f"{LOCK_FILE}.{record['token']}.stale")
                try:  # moved aside whole (one rename: of several starters, one moves it), not written
                    path.rename(aside)
                except FileNotFoundError:
                    continue
                moved = _read(aside)
                if moved != holder:  # another start replaced it a moment ago: its lock goes back, this start yields
                    try:
                        os.link(aside, path)
                    finally:
                        aside.unlink(missing_ok=True)
                    raise refusal(path, moved or {}) from None
                aside.unlink()
                lines.append(f"{path}: took over the lock of {holder_text(holder)}: {why}")
                continue
            _held.update(path=path, token=record["token"], created=created)
            return lines
    finally:
        tmp.unlink(missing_ok=True)
    raise InputError(f"{path} kept changing while this start tried to take it", "run directory lock",
                     "another start is taking this run directory; run one job at a time")


def release() -> None:
    """Remove this process's lock if it holds one (its token still in the file), and the directories acquire()
    created if they are empty; safe to call on any exit path, more than once."""
    if not _held:
        return
    path, token, created = _held["path"], _held["token"], _held["created"]
    _held.clear()
    try:
        if json.loads(path.read_text()).get("token") == token:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass
    for directory in created:
        try:
            directory.rmdir()
        except OSError:
            break
