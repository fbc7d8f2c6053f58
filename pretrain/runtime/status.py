"""<run_dir>/status.json (the batch script's contract) and how a failure is classified and reported."""
import json
import os
import signal
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from pretrain.atomic import publish, temporary_name, write_atomically
from pretrain.errors import EXIT_UNEXPECTED, PEER_LOST, ProjectError, RunInterrupted, peer_error

STATUS_FILE = "status.json"


def write_status(run_dir: Path, status: str, reason: str, world_size: int, steps: int, exit_code: int,
                 error: str = "", first: bool = False, outranks: str = "") -> bool:
    """Write status.json atomically (tmp + rename): ok | interrupted | failed, why, and the exit code.

    first=True writes only when no status.json exists: the first failure of a run is its cause, and
    the ranks that fail after it (a peer gone, a collective that lost it) must not overwrite it —
    except that a first=True write still replaces a status whose error contains `outranks` (a
    consequence recorded a moment before the cause; see record_failure).
    Returns whether it was written; a run_dir that cannot be written is skipped (the error says why).
    """
    body = json.dumps({"status": status, "reason": reason, "world_size": world_size, "steps": steps,
                       "exit_code": exit_code, "error": error}, indent=2)
    target = Path(run_dir) / STATUS_FILE
    tmp = temporary_name(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if not first:
            write_atomically(target, body)
            return True
        tmp.write_text(body)
        try:
            os.link(tmp, target)  # atomic create-if-absent, with complete content
            return True
        except FileExistsError:
            if outranks and outranks in _recorded_error(target):
                publish(tmp, target)
                return True
            return False
        finally:
            tmp.unlink(missing_ok=True)
    except OSError:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        return False


JOB_FILE = "job.json"


def record_job(run_dir: Path, job: dict, world_size: int) -> None:
    """Under Slurm, <run_dir>/job.json: the allocation a started run trains on (slurm/collect.py's GPUs),
    with the command's config and overrides (`job`). Written by rank 0 once the run has started."""
    env = os.environ
    if "SLURM_JOB_ID" not in env:
        return
    record = {"job_id": env.get("SLURM_JOB_ID"), "restart": int(env.get("SLURM_RESTART_COUNT", 0) or 0),
              "nodes": int(env.get("SLURM_JOB_NUM_NODES", 1) or 1), "world_size": world_size,
              "nodelist": env.get("SLURM_JOB_NODELIST"), "config": job.get("config"),
              "overrides": list(job.get("overrides", [])), "container": env.get("ZERO3D_CONTAINER"),
              "start_time": time.time()}
    write_atomically(Path(run_dir) / JOB_FILE, json.dumps(record, indent=2) + "\n")


def finished(run_dir: Path) -> bool:
    """The run in run_dir completed (status.json "ok"): an error before a later start must not replace it."""
    try:
        return json.loads((Path(run_dir) / STATUS_FILE).read_text()).get("status") == "ok"
    except (OSError, ValueError, AttributeError):
        return False


def clear_status(run_dir: Path) -> None:
    """Rank 0 at start: a previous run's status must not be read as this run's."""
    try:
        (Path(run_dir) / STATUS_FILE).unlink(missing_ok=True)
    except OSError:
        pass


def as_project_error(err: BaseException, rank: Optional[int], timeout_s: float) -> Optional[ProjectError]:
    """The project's error for `err`: itself (data and tokenizer errors among them), a collective failure as a
    peer timeout; None for an unexpected error."""
    if isinstance(err, ProjectError):
        return err
    if isinstance(err, KeyboardInterrupt):  # SIGINT before the loop's StopRequest handles it
        return RunInterrupted("interrupted (SIGINT) during start-up, before the first step", "",
                              "nothing was trained or saved now; run the same command to start again")
    return peer_error(err, -1 if rank is None else rank, timeout_s)


def error_line(err: BaseException, rank: Optional[int], timeout_s: float) -> str:
    known = as_project_error(err, rank, timeout_s)
    if known is not None:
        return known.line()
    text = (str(err).strip().splitlines() or [""])[0]
    where = f"rank {rank}" if rank is not None else "start-up"
    return (f"error: unexpected {type(err).__name__}: {text} ({where}): this is a bug or an unforeseen "
            "failure; the traceback above shows where")


def exit_code(err: BaseException, rank: Optional[int], timeout_s: float) -> int:
    known = as_project_error(err, rank, timeout_s)
    return known.exit_code if known is not None else EXIT_UNEXPECTED


def is_agreed(err: BaseException, rank: Optional[int], timeout_s: float) -> bool:
    """Raised identically on every rank (reported once, by rank 0)."""
    known = as_project_error(err, rank, timeout_s)
    return known is not None and known.agreed


def should_report(err: BaseException, rank: Optional[int], timeout_s: float) -> bool:
    """Rank 0 reports agreed errors; every rank reports its own (or a rank not yet known)."""
    return rank is None or rank == 0 or not is_agreed(err, rank, timeout_s)


def report(err: BaseException, rank: Optional[int], timeout_s: float, debug: bool, stream) -> int:
    """Print the one line (traceback first when unexpected or debugging); return the exit code."""
    code = exit_code(err, rank, timeout_s)
    if should_report(err, rank, timeout_s):
        if debug or code == EXIT_UNEXPECTED:
            traceback.print_exception(err, file=stream)
        print(error_line(err, rank, timeout_s), file=stream, flush=True)
    return code


def _recorded_error(target: Path) -> str:
    try:
        return str(json.loads(target.read_text()).get("error", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def record_failure(err: BaseException, run_dir: Path, rank: Optional[int], world_size: int, steps: int,
                   timeout_s: float, lost: str = "") -> None:
    """status.json "failed": rank 0 writes an agreed error outright; any other failure is written by
    the first rank to fail (later ones are consequences), except that a collective timeout (a live peer
    that stopped answering: a cause) replaces a lost connection (a peer that exited: possibly the timed-out
    rank itself, whose exit can reach another rank a moment before its own status is written).
    `lost`: the peers that stopped answering (topology.lost_peers, "ranks 2, 3 on z3node2"), named first
    in the reason."""
    reason = f"{type(err).__name__}: {err}".splitlines()[0]
    if lost:
        reason = f"lost {lost}: {reason}"
    authoritative = rank == 0 and is_agreed(err, rank, timeout_s)
    peer = peer_error(err, rank, timeout_s) if rank is not None else None
    timed_out = peer is not None and peer.what != PEER_LOST
    with sigterm_ignored():
        write_status(run_dir, "failed", reason, world_size, steps, exit_code(err, rank, timeout_s),
                     error_line(err, rank, timeout_s), first=not authoritative,
                     outranks=PEER_LOST if timed_out else "")


@contextmanager
def sigterm_ignored():
    """A launcher that saw another rank exit sends SIGTERM: the status is written before this rank goes."""
    try:
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:  # not the main thread (the watchdog): nothing to defer
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
