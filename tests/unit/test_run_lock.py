"""<run_dir>/run.lock (pretrain/runtime/lock.py): a live holder refuses a second start; a stale one is taken over only
when its end is certain — its process gone from this host, or Slurm having ended it (a requeue of the same job, or an
earlier job of the run directory's singleton name); released by its holder alone. (Through the real command:
tests/dist/test_refused_start.py.)"""
import json
import os
import socket
import subprocess
import time

import psutil
import pytest

from pretrain.errors import InputError
from pretrain.runtime import lock


def holder(**changes) -> dict:
    base = {"host": socket.gethostname(), "pid": os.getpid(), "pid_started": psutil.Process().create_time(),
            "job_id": None, "restart": 0, "job_name": None, "user": "me", "since": time.time(), "token": "other"}
    return {**base, **changes}


def dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


SLURM = {"SLURM_JOB_ID": "120", "SLURM_RESTART_COUNT": "1", "SLURM_JOB_NAME": "tiny-1a2b3c4d"}


def test_only_a_certain_end_makes_a_lock_stale(monkeypatch):
    monkeypatch.setattr(lock, "_user", lambda: "me")
    assert lock.stale_reason(holder(), {}) is None  # this live process
    assert lock.stale_reason(holder(pid=dead_pid()), {}) == "its process is gone"
    assert lock.stale_reason(holder(pid_started=1.0), {}) == "its pid now belongs to a later process"
    # another host: its process cannot be seen from here, so it is alive unless Slurm says otherwise
    elsewhere = holder(host="node-elsewhere", pid=dead_pid())
    assert lock.stale_reason(elsewhere, {}) is None
    assert lock.stale_reason({**elsewhere, "job_id": "120", "restart": 0}, SLURM) == (
        "it was an earlier allocation of this job (restart 0), which Slurm ended")
    assert lock.stale_reason({**elsewhere, "job_id": "120", "restart": 1}, SLURM) is None  # this very allocation
    earlier = {**elsewhere, "job_id": "119", "job_name": "tiny-1a2b3c4d"}
    assert lock.stale_reason(earlier, SLURM) is None  # without singleton, job 119 may still run
    singleton = {**SLURM, lock.SINGLETON_VARIABLE: "1"}
    assert lock.stale_reason(earlier, singleton).startswith("Slurm job 119 of this run directory's name ended")
    assert lock.stale_reason({**earlier, "job_id": "121"}, singleton) is None  # a later job: not covered
    assert lock.stale_reason({**earlier, "job_name": "other-00000000"}, singleton) is None
    assert lock.stale_reason({**earlier, "user": "you"}, singleton) is None


def test_acquire_refuses_a_live_holder_takes_over_a_stale_one_and_release_removes_only_its_own(tmp_path):
    run_dir = tmp_path / "runs" / "a"
    lock.acquire(run_dir)
    ours = json.loads((run_dir / lock.LOCK_FILE).read_text())
    assert (ours["host"], ours["pid"]) == (socket.gethostname(), os.getpid())
    lock.check_free(run_dir)  # its own lock does not refuse its holder
    lock.release()
    assert not run_dir.exists() and not (tmp_path / "runs").exists()  # what acquire created, removed again

    run_dir.mkdir(parents=True)
    (run_dir / lock.LOCK_FILE).write_text(json.dumps(holder()))
    with pytest.raises(InputError, match=r"run directory .* is in use: run.lock is held by pid \d+ on host "):
        lock.check_free(run_dir)
    with pytest.raises(InputError, match="is in use"):
        lock.acquire(run_dir)
    assert json.loads((run_dir / lock.LOCK_FILE).read_text())["token"] == "other"  # left as it was
    lock.release()  # holds nothing: removes nothing
    assert (run_dir / lock.LOCK_FILE).exists()

    stale = holder(pid=dead_pid())
    (run_dir / lock.LOCK_FILE).write_text(json.dumps(stale))
    (line,) = lock.acquire(run_dir)
    assert line.startswith(f"{run_dir / lock.LOCK_FILE}: took over the lock of pid {stale['pid']} on host ")
    assert json.loads((run_dir / lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert sorted(p.name for p in run_dir.iterdir()) == [lock.LOCK_FILE]  # nothing left aside
    lock.release()
    assert list(run_dir.iterdir()) == [] and run_dir.exists()  # the directory was there before: kept
