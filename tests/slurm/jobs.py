"""Helpers for the Slurm tier: a job's `scontrol show job` fields, waiting for its end or for a condition."""
import re
import subprocess
import time

import pytest

from slurm.local_cluster import LocalCluster

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def job_fields(cluster: LocalCluster, job_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=cluster.env(),
                         capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def wait_for(cluster: LocalCluster, job_id: str, log_glob, timeout: float = 300.0) -> dict:
    """The job's `scontrol show job` fields once it reached a terminal state; fails (and cancels) on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        fields = job_fields(cluster, job_id)
        if fields.get("JobState") in TERMINAL:
            return fields
        if time.monotonic() > deadline:
            logs = "\n".join(p.read_text(errors="replace")[-4000:] for p in log_glob.parent.glob(log_glob.name))
            subprocess.run(["scancel", job_id], env=cluster.env())
            pytest.fail(f"job {job_id} not finished after {timeout:.0f}s ({fields.get('JobState')})\n{logs}\n"
                        f"{cluster.logs()}")
        time.sleep(1)


def wait_until(predicate, timeout: float, what: str, log_glob):
    """Poll `predicate` until true; past `timeout`, fail with the tail of the logs `log_glob` (a Path glob) names."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            text = "\n".join(p.read_text(errors="replace")[-4000:] for p in log_glob.parent.glob(log_glob.name))
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{text}")
        time.sleep(0.2)
