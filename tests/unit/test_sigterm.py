"""SIGTERM to a rank (scancel, a container's stop, a preemption without --signal) is a stop: after the step, a
checkpoint, status.json "interrupted", exit 75, and the same command resumes from that checkpoint; so is SIGUSR1
(Slurm's warning before the time limit), which `python -m pretrain` blocks from its first line until the loop's
handler takes it. The command runs as users run it (`python -m pretrain`, forked from a process that imported torch
once: tests/cli_fork.py)."""
import json
import os
import signal
import time
from pathlib import Path

import pytest

from cli_fork import run_pretrain_cli, run_python, start_python
from pretrain.errors import EXIT_PEER, EXIT_REQUEUE

pytestmark = pytest.mark.one_core  # one process at a time, seconds each: the side lane (tools/run_suite.py)
REPO = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_NODELIST", "SLURM_STEP_NODELIST", "ZERO3D_DEBUG",
                 "ZERO3D_EXIT_FILE", "ZERO3D_INTERRUPTED_EXIT")
TINY = ["--config", "configs/tiny.toml", "parallel.tensor=1", "model.num_layers=1", "model.hidden_size=32",
        "model.num_attention_heads=4", "model.seq_length=16", "model.vocab_size=384", "train.micro_batch_size=2",
        "train.global_batch_size=2", "train.eval_interval=0", "optimizer.warmup_steps=0", "train.save_interval=0",
        "zero.bucket_elements=1000", "logging.wandb=false", "logging.console=plain", "logging.log_interval=1",
        "optimizer.decay_steps=300"]  # fixed: the resume (a shorter train.steps) keeps the interrupted run's schedule


def logged_steps(run_dir: Path) -> list[int]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_stop_signal_stops_after_the_step_with_a_checkpoint_and_exit_75(tmp_path, signum):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS} | {"OMP_NUM_THREADS": "1"}
    run_dir, corpus = tmp_path / "run", tmp_path / "corpus.jsonl"
    corpus.write_text("".join((REPO / "data" / "corpus.jsonl").read_text().splitlines(keepends=True)[:100]))
    args = [*TINY, f"logging.run_dir={json.dumps(str(run_dir))}", f"data.corpus={json.dumps(str(corpus))}",
            f"data.cache_dir={json.dumps(str(tmp_path / 'cache'))}"]
    command = start_python(["-m", "pretrain", *args, "train.steps=300", "train.save_final=false"], env, REPO)
    deadline = time.monotonic() + 240
    while len(logged_steps(run_dir)) < 2 and command.running() and time.monotonic() < deadline:
        time.sleep(0.05)  # until it trains: the signal lands in a step
    if command.running():  # else its output says why it ended
        os.kill(command.pid, signum)
    out = command.finish(timeout=60)  # the step, then a checkpoint of a tiny model: seconds
    status = json.loads((run_dir / "status.json").read_text())
    step = status["steps"]
    assert (out.returncode, status["status"], status["exit_code"]) == (EXIT_REQUEUE, "interrupted", 75), out.stderr
    assert logged_steps(run_dir)[-1] == step >= 2  # stopped after the step the signal came in, saved at it
    assert out.stderr.splitlines()[-1] == (f"stopped by a signal (SIGINT/SIGUSR1/SIGTERM) after step {step} of "
                                           f"300: checkpoint step_{step:08d} saved, status.json \"interrupted\"; "
                                           "run the same command to resume")
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{step:08d}\n"
    # the same command (a requeued job; here one step longer) continues from that checkpoint
    resumed = run_pretrain_cli([*args, f"train.steps={step + 1}"], env, REPO, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step_{step:08d}" in resumed.stdout and f"continuing at step {step + 1}" in resumed.stdout
    assert logged_steps(run_dir)[-1] == step + 1


# The launcher's SIGTERM reaching a failing rank (a peer that failed a moment earlier has exited): sent to itself at the
# two places a rank's failure is said, lost_peers' settle and the line's report, where the default action ended it.
RECORD_UNDER_SIGTERM = """import os, signal, sys
from pathlib import Path
from pretrain.runtime import lifecycle
def lost_peers():
    os.kill(os.getpid(), signal.SIGTERM)
    return "rank 2 on z3node2"
lifecycle.lost_peers = lost_peers
class Rank3:
    rank = 3
err = RuntimeError("[pair.cc:598] Timed out waiting 15000ms for recv operation to complete")
lifecycle.record_rank_failure(err, Path(sys.argv[1]), {"rank": 3, "world_size": 4}, Rank3(), 7, 15.0)
print("recorded")
"""
REPORT_UNDER_SIGTERM = """import os, signal, sys
import pretrain.__main__ as cli
from pretrain.errors import PeerTimeoutError
def load_config(*args):
    raise PeerTimeoutError("a collective waited longer than train.timeout_minutes (15 s) for a peer rank", "rank 3",
                           "see the other ranks' logs")
said = cli.report
def report(*args):
    os.kill(os.getpid(), signal.SIGTERM)
    return said(*args)
cli.load_config, cli.report = load_config, report
sys.exit(cli.main(["--config", "configs/tiny.toml"]))
"""


@pytest.mark.timeout(120)
def test_a_failing_rank_records_and_says_its_failure_through_the_launchers_sigterm(tmp_path):
    """torchrun SIGTERMs every rank once the first failed one exits; the ranks whose collectives timed out with it are
    then in lost_peers' 3-s settle or saying their line, and by SIGTERM's default action died silent and unrecorded
    (test_fail_fast: a live rank without its error line, one loaded suite run in three)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    (tmp_path / "record.py").write_text(RECORD_UNDER_SIGTERM)
    (tmp_path / "report.py").write_text(REPORT_UNDER_SIGTERM)
    recorded = run_python([str(tmp_path / "record.py"), str(tmp_path)], env, REPO, timeout=60)
    assert (recorded.returncode, recorded.stdout) == (0, "recorded\n"), recorded.stderr[-2000:]
    status = json.loads((tmp_path / "status.json").read_text())
    assert (status["status"], status["exit_code"], status["steps"]) == ("failed", EXIT_PEER, 7)
    assert status["reason"] == ("lost rank 2 on z3node2: RuntimeError: [pair.cc:598] Timed out waiting 15000ms for "
                                "recv operation to complete")
    assert status["error"] == ("error: a collective waited longer than train.timeout_minutes (15 s) for a peer rank "
                               "(rank 3): a peer is stuck or overloaded; see the other ranks' logs, or raise "
                               "train.timeout_minutes if steps are legitimately slower")
    said = run_python([str(tmp_path / "report.py")], env, REPO, timeout=60)
    assert said.returncode == EXIT_PEER, (said.returncode, said.stderr[-2000:])
    assert said.stderr.splitlines()[-1] == ("error: a collective waited longer than train.timeout_minutes (15 s) for a "
                                            "peer rank (rank 3): see the other ranks' logs"), said.stderr
