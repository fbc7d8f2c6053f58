"""Preemption and container launch on the real local Slurm: signalled, checkpointed, requeued, resumed."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm import collect
from tests.slurm.jobs import job_fields, wait_for, wait_until

REPO = Path(__file__).resolve().parents[2]
# Enough steps that the signal, sent once step 3 is logged, reaches the run before its last step: with 8, a loaded
# suite once saw the run finish its other 5 steps (~1.5 s) before scancel's signal arrived, and no requeue came.
STEPS = 30
# TP 2 × DP 2 on 4 CPU ranks, a checkpoint only when stopped (save_final off), every step logged.
TINY = ["--config", "configs/tiny.toml", f"train.steps={STEPS}", "train.eval_interval=0", "train.save_final=false",
        "logging.wandb=false", "logging.log_interval=1"]

# A stand-in for pyxis: srun's --container-* options are recorded and removed, and the real srun runs
# the rest, so the geometry (nodes, tasks, SLURM_NTASKS inside the step) is the real one.
SRUN_SHIM = """#!/bin/bash
args=() image=
for a in "$@"; do
    case $a in
        --container-image=*) image=${a#*=} ;;
        --container-*) ;;
        *) args+=("$a") ;;
    esac
done
[[ -n $image ]] && echo "image=$image argv=$*" >> "$ZERO3D_TEST_CONTAINER_LOG"
exec {srun} "${args[@]}"
"""


def submit(cluster, run_dir: Path, *extra, env=None) -> str:
    cmd = [sys.executable, "slurm/submit.py", "--cpu", *TINY, f"logging.run_dir={run_dir}", *extra]
    proc = subprocess.run(cmd, env=cluster.env(env or dict(os.environ, ZERO3D_PYTHON=sys.executable)),
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def losses(run_dir: Path) -> dict:
    return {r["step"]: r["train/loss"] for r in collect.read_records(run_dir / "metrics.jsonl")}


@pytest.mark.timeout(600)
def test_container_job_and_a_preempted_job_requeue_resume_and_match(cluster, tmp_path):
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "srun").write_text(SRUN_SHIM.replace("{srun}", shutil.which("srun", path=cluster.env()["PATH"])))
    (shim / "srun").chmod(0o755)
    container_log = tmp_path / "container.log"
    env = dict(os.environ, ZERO3D_PYTHON=sys.executable, PATH=f"{shim}:{os.environ['PATH']}",
               ZERO3D_TEST_CONTAINER_LOG=str(container_log))

    # Tokenizer and token files built once here, so the two jobs below read the same ones.
    from pretrain.config import DataConfig
    from pretrain.data.datasets import prepare_files
    prepare_files(DataConfig(corpus=str(REPO / "data/corpus.jsonl"), cache_dir=str(REPO / "runs/data")), 1024)
    # (1) the reference: container mode, never interrupted; (2) the same run, requeueable, signalled mid-run
    ref_dir, run_dir = tmp_path / "reference", tmp_path / "preempted"
    # the run directory lies outside the repository: mounted into the container at its own path
    ref_id = submit(cluster, ref_dir, "--container", "/images/zero3d.sqsh",
                    env=dict(env, ZERO3D_CONTAINER_MOUNTS=f"{tmp_path}:{tmp_path}"))
    job_id = submit(cluster, run_dir, "--requeue")
    wait_until(lambda: max(losses(run_dir), default=0) >= 3, 300, "step 3 of the preempted job",
               run_dir / "slurm-*.out")
    subprocess.run(["scancel", "--signal=USR1", job_id], env=cluster.env(), check=True)
    requeued = {"Restarts": "1", "JobState": "PENDING"}
    wait_until(lambda: requeued.items() <= job_fields(cluster, job_id).items(), 180, "the requeue",
               run_dir / "slurm-*.out")
    stopped_at = json.loads((run_dir / "job.json").read_text())  # still the first allocation's
    # Slurm holds a requeued job back until its revoked credential expires (cred_expire, 10 s in the local
    # cluster); releasing it sooner ("StartTime=now") races that and fails the launch on "credential revoked".

    ref_state = wait_for(cluster, ref_id, ref_dir / "slurm-*.out", timeout=300)
    state = wait_for(cluster, job_id, run_dir / "slurm-*.out", timeout=300)
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    ref_log = (ref_dir / f"slurm-{ref_id}.out").read_text()

    # container mode: the preflight ran as a one-task step in the image, for the job's 4 ranks
    assert ref_state["JobState"] == "COMPLETED" and ref_state["ExitCode"] == "0:0", ref_log
    assert ref_state["NumTasks"] == "4" and json.loads((ref_dir / "config.json").read_text())["train"]["steps"] == STEPS
    launched = container_log.read_text().splitlines()
    preflight = [line for line in launched if "--preflight" in line]
    assert len(preflight) == 1 and "--ntasks=1" in preflight[0] and "--world-size 4" in preflight[0], launched
    assert all(line.startswith("image=/images/zero3d.sqsh ") for line in launched) and len(launched) == 2
    assert json.loads((ref_dir / "job.json").read_text())["world_size"] == 4
    assert json.loads((ref_dir / "status.json").read_text())["world_size"] == 4
    row = collect.collect_run(ref_dir, warmup=1)
    assert (row["status"], row["gpus"], row["mp"], row["steps"], row["config"]) == ("ok", 4, 2, STEPS, "C3")
    assert row["tflops_per_gpu"] > 0 and row["peak_mem_GB"] > 0 and row["comm_elements_per_step"] > 0
    assert row["pflops"] == pytest.approx(row["tflops_per_gpu"] * 4 / 1000)

    # preemption: stopped after a checkpoint on every rank, requeued, resumed, completed
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1" and state["ExitCode"] == "0:0", log
    assert "run status: interrupted" in log and f"requeueing job {job_id}" in log, log
    assert "restart 0" in log and "restart 1" in log and "run status: ok" in log, log
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert len(checkpoints) == 1, checkpoints  # the stop's checkpoint; save_final is off
    stop_step = int(checkpoints[0].name.split("_")[1])
    assert 3 <= stop_step < STEPS, log
    # a complete DCP checkpoint: its manifest, every rank's RNG state and a part from every rank
    assert (checkpoints[0] / "checkpoint.json").is_file()
    assert sorted(p.name for p in (checkpoints[0] / "rng").glob("rank_*.json")) == [f"rank_{r:05d}.json" for r in range(4)]
    assert len(list(checkpoints[0].glob("__*_0.distcp"))) == 4
    assert stopped_at["restart"] == 0 and json.loads((run_dir / "job.json").read_text())["restart"] == 1
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["steps"], status["world_size"]) == ("ok", STEPS, 4)
    # the resumed run continues the uninterrupted one's loss curve, step for step
    reference, resumed = losses(ref_dir), losses(run_dir)
    assert sorted(reference) == sorted(resumed) == list(range(1, STEPS + 1))
    assert resumed == pytest.approx(reference, abs=1e-6, rel=0), (stop_step, resumed, reference)


def sigusr1_blocked(pid: int) -> bool:
    """Whether the process holds SIGUSR1 blocked (bit 10 - 1 of SigBlk in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)
    return False


@pytest.mark.timeout(300)
def test_sigusr1_before_the_handler_stops_the_run_at_its_first_step(tmp_path):
    """No Slurm needed: `python -m pretrain` blocks SIGUSR1 from its first lines, so a signal sent while
    torch still imports waits for the loop's handler instead of killing the rank (exit 138)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "pretrain", *TINY, f"logging.run_dir={run_dir}", "parallel.tensor=1",
           "train.global_batch_size=4"]
    env = {k: v for k, v in os.environ.items() if k not in ("ZERO3D_INTERRUPTED_EXIT", "RANK", "WORLD_SIZE")}
    env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while not sigusr1_blocked(proc.pid):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.005)
    assert not (run_dir / "metrics.jsonl").exists()  # long before the loop and its handler
    proc.send_signal(signal.SIGUSR1)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 75, out  # interrupted after a complete checkpoint
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["steps"]) == ("interrupted", 1), out
    assert [p.name for p in (run_dir / "checkpoints").glob("step_*")] == ["step_00000001"]
