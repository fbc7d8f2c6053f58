"""`python -m pretrain.launcher`: the console shows zero3d's lines and codes, not a launcher's traceback;
Ctrl-C (SIGINT to the launcher) is a stop with a checkpoint, twice an immediate end; a killed rank is named."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.side_lane  # ~60 s of launches: run beside the compute lane (tools/run_suite.py)
REPO = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                 "ZERO3D_DEBUG", "ZERO3D_INTERRUPTED_EXIT")
# steps of ~0.3 s on a CPU rank: a signal lands inside a step
SLOW = ["--config", "configs/tiny.toml", "parallel.tensor=1", "model.num_layers=4", "model.hidden_size=256",
        "model.num_attention_heads=4", "model.seq_length=256", "model.vocab_size=512", "train.micro_batch_size=4",
        "train.global_batch_size=8", "train.eval_interval=0", "train.steps=100000", "train.save_interval=0",
        "train.save_final=false", "logging.wandb=false", "logging.console=plain", "logging.log_interval=1",
        "logging.straggler_factor=1000"]


def launch(args: list, run_dir: Path, tmp_path: Path, nproc: int = 2) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS} | {"OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "pretrain.launcher", "--nproc-per-node", str(nproc), *args,
                             f"logging.run_dir={json.dumps(str(run_dir))}",
                             f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def logged(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def wait_for_step(proc, run_dir: Path, records: int, timeout: float = 300.0) -> None:
    """Until metrics.jsonl holds `records` lines (this launch's steps come after the earlier launches')."""
    deadline = time.monotonic() + timeout
    while logged(run_dir) < records:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no record {records}:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.05)


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.timeout(300)
def test_a_config_error_is_one_line_and_its_code(tmp_path):
    proc = launch(["--config", "configs/tiny.toml", "optimizer.lr=inf"], tmp_path / "run", tmp_path)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 2
    first, last = lines(err)  # rank 0's line (the error is every rank's: rank 0 reports it), the launcher's
    assert first == "error: optimizer.lr = inf is invalid (config): must be a finite number"
    assert last.startswith("launcher: rank ") and last.endswith(
        " exited with code 2 (config error); the other ranks were stopped (its own line above says why)"), last
    assert "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.timeout(600)
def test_ctrl_c_once_stops_with_a_checkpoint_twice_at_once_and_a_killed_rank_is_named(tmp_path):
    run_dir = tmp_path / "run"
    proc = launch(SLOW, run_dir, tmp_path)
    wait_for_step(proc, run_dir, 2)
    proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends the launcher (the ranks have their own session)
    _, err = proc.communicate(timeout=240)
    status = json.loads((run_dir / "status.json").read_text())
    step = status["steps"]
    assert (proc.returncode, status["status"], status["exit_code"]) == (75, "interrupted", 75), err
    assert lines(err) == [f"stopped by a signal (SIGINT/SIGUSR1/SIGTERM) after step {step} of 100000: checkpoint "
                          f"step_{step:08d} saved, status.json \"interrupted\"; run the same command to resume"]
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{step:08d}\n"
    assert not (run_dir / "run.lock").exists()  # released by rank 0 as it ended

    # the same command resumes; a rank killed -9 is named, the others stopped, the code is 128 + 9
    before = logged(run_dir)
    proc = launch(SLOW, run_dir, tmp_path)
    wait_for_step(proc, run_dir, before + 1)
    import psutil
    (victim,) = [c for c in psutil.Process(proc.pid).children() if c.environ().get("RANK") == "1"]
    victim.kill()
    out, err = proc.communicate(timeout=120)
    assert f"resumed from step_{step:08d}" in out
    assert proc.returncode == 137, err
    assert lines(err)[-1] == ("launcher: rank 1 was killed by SIGKILL; the other ranks were stopped (its own line "
                              "above says why)")
    assert "Traceback" not in err

    # Ctrl-C twice: ended within seconds, one line, exit 130, no new checkpoint. Steps of 4 micro-batches
    # (about a second) and 0.3 s between the two: the first is taken (a signal that arrives while the same
    # one is still pending merges with it) and the second lands in the same step, or in the stop's save
    before = logged(run_dir)
    proc = launch(SLOW + ["train.global_batch_size=32"], run_dir, tmp_path)
    wait_for_step(proc, run_dir, before + 1)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    sent = time.monotonic()
    for _ in range(10):  # Ctrl-C pressed again (and again, as a user would, should a press merge with the first)
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=0.3)
            break
        except subprocess.TimeoutExpired:
            pass
    _, err = proc.communicate(timeout=60)
    ended_after = time.monotonic() - sent
    print(f"two SIGINTs: the ranks ended {ended_after:.2f} s after the second")
    assert ended_after < 10 and proc.returncode == 130, err
    interrupted = [line for line in lines(err) if line.startswith("error: ")]
    assert len(interrupted) == 1 and interrupted[0].startswith("error: interrupted twice (SIGINT) at step "), err
    assert lines(err)[-1].startswith("launcher: rank ") and "exited with code 130 (interrupted at once)" in err
    assert "Traceback" not in err
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["exit_code"]) == ("failed", 130)
    assert not (run_dir / "run.lock").exists()  # released before the second SIGINT's immediate exit
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{step:08d}\n"
