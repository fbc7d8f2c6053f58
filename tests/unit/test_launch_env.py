"""slurm/launch.sbatch's environment (#39): Slurm's time-limit forms, OMP threads per rank, CUDA_DEVICE_MAX_CONNECTIONS
at TP > 1 and requeue on by default — the script run for real with stub srun / scontrol / python."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from slurm import submit  # noqa: E402


@pytest.mark.parametrize("text,seconds", [
    ("90", 90 * 60), ("10:30", 10 * 60 + 30), ("05:30:00", 5 * 3600 + 30 * 60),
    ("1-12", 36 * 3600), ("1-12:30", 36 * 3600 + 30 * 60), ("2-00:00:15", 48 * 3600 + 15), ("0-1", 3600),
])
def test_every_slurm_time_form(text, seconds):
    assert submit.time_limit_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "1:2:3:4", "1-", "-5", "1-2-3", "1h", "1-2:3:4:5", "1:-2"])
def test_bad_time_limit_names_the_forms(text):
    with pytest.raises(ValueError, match=f"time limit {text!r} is invalid; Slurm's forms: MM, MM:SS, HH:MM:SS"):
        submit.time_limit_seconds(text)


@pytest.mark.parametrize("text", ["1:2:3:4", "1-", "1-2-3", "1h"])
def test_bad_time_limit_is_one_config_line(text, capsys):
    assert submit.main(["--config", "configs/tiny.toml", f"cluster.time_limit={text}", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"config error: cluster.time_limit = {text!r} is invalid; Slurm's forms: MM, MM:SS, HH:MM:SS, "
                   "D-HH, D-HH:MM, D-HH:MM:SS")


def test_requeue_is_on_unless_opted_out(capsys):
    assert submit.main(["--config", "configs/tiny.toml", "--dry-run"]) == 0
    sbatch = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("sbatch:"))
    assert sbatch.startswith("sbatch:    ZERO3D_REQUEUE=1 ZERO3D_SINGLETON=1 sbatch") and " --requeue " in sbatch
    assert submit.main(["--config", "configs/tiny.toml", "--dry-run", "--no-requeue"]) == 0
    sbatch = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("sbatch:"))
    assert sbatch.startswith("sbatch:    ZERO3D_SINGLETON=1 sbatch") and " --no-requeue " in sbatch  # the launcher reads the job's flag


STUB_PY = """#!/bin/bash
# the preflight: write the resolved config.json a TP-{tp} config has, print the run dir
mkdir -p "$RUN" && printf '{{\\n  "parallel": {{\\n    "tensor": {tp},\\n    "pipeline": 1\\n  }}\\n}}\\n' > "$RUN/config.json"
echo "$RUN"
"""
STUB_SRUN = """#!/bin/bash
# the ranks: record what they were given, stop as interrupted after a checkpoint
echo "OMP=$OMP_NUM_THREADS CONN=${CUDA_DEVICE_MAX_CONNECTIONS:-unset}" > "$RUN/env.txt"
printf '{\\n  "status": "interrupted"\\n}\\n' > "$RUN/status.json"
"""

SCONTROL = """#!/bin/bash
# show hostnames: the node; show job: the job's fields, Requeue as $REQUEUABLE; requeue: recorded
echo "scontrol $*" >> "$RUN/scontrol.txt"
case "$1 $2" in
    "show hostnames") echo node1 ;;
    "show job") echo "JobId=$3 JobName=tiny Requeue=${REQUEUABLE:-1} Restarts=0" ;;
esac
"""


def launch(tmp_path, tp, **env):
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    for name, text in (("py", STUB_PY.format(tp=tp)), ("srun", STUB_SRUN),
                       ("scontrol", SCONTROL)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    run = tmp_path / f"run{tp}"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMP_", "CUDA_DEVICE", "ZERO3D_"))}
    full = dict(base, PATH=f"{bin_}:{base['PATH']}", RUN=str(run), ZERO3D_PYTHON=str(bin_ / "py"),
                SLURM_JOB_ID="7", SLURM_NTASKS="8", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="node1",
                SLURM_NTASKS_PER_NODE="8", SLURM_CPUS_ON_NODE="96", **env)
    proc = subprocess.run(["bash", str(REPO / "slurm/launch.sbatch"), "configs/tiny.toml"], env=full, cwd=REPO,
                          capture_output=True, text=True, timeout=30)
    scontrol = (run / "scontrol.txt").read_text() if (run / "scontrol.txt").exists() else ""
    return proc, (run / "env.txt").read_text().split(), scontrol


def test_launch_env_at_tp2_and_tp1(tmp_path):
    proc, env, scontrol = launch(tmp_path, 2)
    assert env == ["OMP=12", "CONN=1"]  # 96 CPUs on the node ÷ 8 ranks; TP 2: one CUDA connection
    assert proc.returncode == 0 and "requeue 7" in scontrol  # interrupted, a requeueable job: requeued
    proc, env, scontrol = launch(tmp_path, 1, SLURM_CPUS_PER_TASK="5", REQUEUABLE="0")
    assert env == ["OMP=5", "CONN=unset"]  # --cpus-per-task wins; TP 1 leaves CUDA's default
    assert proc.returncode == 75 and "scontrol requeue" not in scontrol and "--no-requeue" in proc.stdout
    proc, _, scontrol = launch(tmp_path, 1, REQUEUABLE="1", ZERO3D_REQUEUE="0")  # told not to: not requeued
    assert proc.returncode == 75 and "scontrol requeue" not in scontrol
