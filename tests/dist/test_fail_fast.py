"""Fail fast and loud: bad data/tokenizer/checkpoint inputs, non-finite training, stuck peers (torchrun, CPU)."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import ranks  # noqa: F401 - megatron imported before the forks below
from pretrain.errors import EXIT_INPUT, EXIT_NUMERICAL, EXIT_PEER
from pretrain.runtime.status import write_status

REPO = Path(__file__).resolve().parents[2]
# Most of this module is waiting for timeouts and watchdogs to fire: `make test` runs it in the side lane.
pytestmark = pytest.mark.waits
TORCHRUN = Path(sys.executable).parent / "torchrun"
SMALL = ["--config", "configs/tiny.toml", "model.num_layers=1", "model.hidden_size=32", "model.seq_length=16",
         "model.vocab_size=512", "train.micro_batch_size=2", "train.eval_interval=0", "logging.wandb=false",
         "logging.console=plain"]
ONE_RANK = SMALL + ["parallel.tensor=1", "train.global_batch_size=2", "train.steps=2"]
# torch's FutureWarning on the older collective names; megatron-core's import-time fallback warnings
CONSOLE_NOISE = ("all_gather_into_tensor", "reduce_scatter_tensor", "Apex is not installed",
                 "Transformer Engine and Apex are not installed", "full scope is deprecated",
                 "CUDA_DEVICE_MAX_CONNECTIONS to 1")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                 "ZERO3D_DEBUG")


def q(path) -> str:
    return json.dumps(str(path))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Tokenizer and .bin/.idx built once; overrides that use them."""
    from pretrain.data.datasets import prepare_files
    cache = tmp_path_factory.mktemp("data")
    from pretrain.config import DataConfig
    files = prepare_files(DataConfig(corpus=str(REPO / "data/corpus.jsonl"), cache_dir=str(cache)), 512)
    return {"cache": cache, "tokenizer": Path(files.tokenizer_path), "prefix": files.prefixes()[0],
            "overrides": [f"data.cache_dir={q(cache)}", f"data.corpus={q(REPO / 'data/corpus.jsonl')}"]}


def run_main_forked(argv: list[str], tmp_path: Path) -> tuple[int, str, str]:
    """`python -m pretrain argv` in a forked child (megatron already imported): exit code, stdout, stderr.

    The child runs the entry point's main() with its own stdout/stderr files, as the command does.
    """
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
            for var in LAUNCHER_VARS:
                os.environ.pop(var, None)
            from pretrain.__main__ import main
            code = main(argv)
        except BaseException:  # noqa: BLE001 - shows up in stderr and fails the test
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), out.read_text(), err.read_text()
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"python -m pretrain {' '.join(argv)} did not finish in 300 s\n{err.read_text()}")


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def assert_one_line(code: int, stdout: str, stderr: str, expected_code: int, expected: str) -> None:
    """Exactly one error line, the expected one, on stderr; no traceback anywhere; the table's exit code."""
    assert "Traceback" not in stdout + stderr, stderr
    lines = error_lines(stdout + "\n" + stderr)
    assert len(lines) == 1 and lines == error_lines(stderr) and lines[0].startswith(expected), stderr
    assert code == expected_code, stderr


def fake_checkpoint(save_dir: Path, manifest, part: bytes = None) -> Path:
    """A step directory whose manifest (checkpoint.json) records one DCP part of 10 bytes; `part` is
    what is actually on disk (None: missing)."""
    import hashlib
    step_dir = save_dir / "step_00000004"
    step_dir.mkdir(parents=True)
    if manifest == "ours":
        manifest = json.dumps({"format": "zero3d-dcp-1", "step": 4, "files": {
            "__0_0.distcp": {"bytes": 10, "sha256": hashlib.sha256(b"0123456789").hexdigest()}}})
    (step_dir / "checkpoint.json").write_text(manifest)
    if part is not None:
        (step_dir / "__0_0.distcp").write_bytes(part)
    (save_dir / "latest").write_text("step_00000004\n")
    return step_dir


def make_input(case: str, tmp: Path, data: dict) -> tuple[list[str], str]:
    """(overrides, start of the expected line) for one malformed data / tokenizer / checkpoint input."""
    save = tmp / "run" / "checkpoints"
    if case == "tokenizer-not-sentencepiece":
        (tmp / "junk.model").write_bytes(b"not a model")
        return ([f"data.tokenizer_model={q(tmp / 'junk.model')}"],
                f"error: tokenizer model '{tmp}/junk.model' is not a sentencepiece model")
    if case == "tokenizer-larger-than-model-vocab":
        return ([f"data.tokenizer_model={q(data['tokenizer'])}", "model.vocab_size=384"],
                "error: tokenizer vocabulary 512 is larger than model.vocab_size 384 (data): raise model.vocab_size")
    if case in ("idx-truncated", "bin-truncated"):
        truncated = ".idx" if case == "idx-truncated" else ".bin"
        for suffix in (".bin", ".idx"):
            body = Path(data["prefix"] + suffix).read_bytes()
            (tmp / f"tokens{suffix}").write_bytes(body[:len(body) // 2] if suffix == truncated else body)
        # ~data.corpus: the corpus the other cases share is unused beside a blend (an error if left set)
        return (["~data.corpus", f"data.blend={q(tmp / 'tokens')}", f"data.tokenizer_model={q(data['tokenizer'])}"],
                f"error: {tmp}/tokens.idx is truncated" if truncated == ".idx"
                else f"error: {tmp}/tokens.bin is shorter than its index says: {tmp}/tokens.idx describes")
    if case == "corpus-invalid-json":
        (tmp / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
        return ([f"data.corpus={q(tmp / 'bad.jsonl')}", f"data.cache_dir={q(tmp / 'cache')}"],
                f"error: {tmp}/bad.jsonl:2: invalid JSON")
    if case == "corpus-empty":
        (tmp / "empty.jsonl").write_text('{"text": ""}\n\n')
        return [f"data.corpus={q(tmp / 'empty.jsonl')}", f"data.cache_dir={q(tmp / 'cache')}"], "error: "
    usable = f"error: no usable checkpoint in {save}: "
    if case == "checkpoint-latest-dangling":
        save.mkdir(parents=True)
        (save / "latest").write_text("step_00000009\n")
        return [], usable + f"{save}/step_00000009/checkpoint.json is missing (checkpoint): repair or remove"
    if case == "checkpoint-manifest-corrupt":
        fake_checkpoint(save, "{not json")
        return [], usable + f"{save}/step_00000004/checkpoint.json is malformed JSON"
    if case == "checkpoint-manifest-foreign":
        fake_checkpoint(save, json.dumps({"step": 4}))
        return [], usable + f"{save}/step_00000004/checkpoint.json is malformed: not a zero3d-dcp-1 manifest"
    if case == "checkpoint-part-missing":
        fake_checkpoint(save, "ours")
        return [], usable + f"{save}/step_00000004/__0_0.distcp is missing"
    if case == "checkpoint-part-truncated":
        fake_checkpoint(save, "ours", part=b"01234")
        return [], usable + (f"{save}/step_00000004/__0_0.distcp has 5 bytes, the manifest records 10 "
                             "(truncated or replaced)")
    if case == "checkpoint-part-tampered":
        fake_checkpoint(save, "ours", part=b"0123456780")
        return [], usable + f"{save}/step_00000004/__0_0.distcp does not match its SHA-256 in checkpoint.json"
    raise AssertionError(case)


INPUT_CASES = ["tokenizer-not-sentencepiece", "tokenizer-larger-than-model-vocab", "idx-truncated", "bin-truncated",
               "corpus-invalid-json", "corpus-empty", "checkpoint-latest-dangling", "checkpoint-manifest-corrupt",
               "checkpoint-manifest-foreign", "checkpoint-part-missing", "checkpoint-part-truncated",
               "checkpoint-part-tampered"]


@pytest.mark.parametrize("case", INPUT_CASES)
def test_malformed_file_gives_one_line_exit_3_and_writes_nothing(tmp_path, data, case):
    """A start refused for its input is its one line and code 3; nothing is written into the run directory
    (the checkpoint cases' own files aside): no config.json, no status.json, no metrics."""
    overrides, expected = make_input(case, tmp_path, data)
    run_dir = tmp_path / "run"
    code, stdout, stderr = run_main_forked(ONE_RANK + data["overrides"] + overrides
                                           + [f"logging.run_dir={q(run_dir)}"], tmp_path)
    assert_one_line(code, stdout, stderr, EXIT_INPUT, expected)
    assert not run_dir.exists() or sorted(p.name for p in run_dir.iterdir()) == ["checkpoints"]


def test_nonfinite_steps_stop_with_exit_4_and_keep_the_last_good_checkpoint(tmp_path, data):
    """lr = 1e30 (finite, so config validation lets it through) turns the weights into NaN producers."""
    run_dir = tmp_path / "run"
    code, stdout, stderr = run_main_forked(
        SMALL + data["overrides"] + ["parallel.tensor=1", "train.global_batch_size=2", "train.steps=8",
                                     "optimizer.lr=1e30", "optimizer.min_lr=0", "optimizer.warmup_steps=0",
                                     "train.save_interval=1", "train.max_nonfinite_steps=2",
                                     f"logging.run_dir={q(run_dir)}"], tmp_path)
    losses = [json.loads(line)["train/loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    finite = [i + 1 for i, loss in enumerate(losses) if loss == loss and abs(loss) != float("inf")]
    last_good = f"step_{finite[-1]:08d}"
    assert len(losses) == finite[-1] + 2  # stopped at the second non-finite step in a row
    assert_one_line(code, stdout, stderr, EXIT_NUMERICAL,
                    f"error: loss or gradient norm not finite for 2 consecutive steps (steps {len(losses) - 1}-"
                    f"{len(losses)}: loss nan")
    assert f"no checkpoint was saved over the last good one ({last_good})" in error_lines(stderr)[0]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == last_good
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == (
        ["latest"] + [f"step_{s:08d}" for s in finite])
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["exit_code"], status["steps"]) == ("failed", EXIT_NUMERICAL, len(losses))


# ---------------------------------------------------------------- torchrun, 4 CPU ranks, TP 2 × DP 2

TIMEOUT_S = 15.0  # train.timeout_minutes, in seconds (margin for rank start-up skew on a loaded machine)


def torchrun(args: list[str], run_dir: Path, log_dir: Path, env: dict = None, script: str = None, nproc: int = 4):
    """torchrun --nproc-per-node N (TP 2) with per-rank stdout/stderr files under log_dir."""
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), "--log-dir", str(log_dir), "--redirects", "3",
           *([script] if script else ["-m", "pretrain"]), *args, "parallel.tensor=2", f"train.global_batch_size={nproc}",
           f"train.timeout_minutes={TIMEOUT_S / 60}", f"logging.run_dir={q(run_dir)}"]
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return subprocess.Popen(cmd, cwd=REPO, env={**clean, "OMP_NUM_THREADS": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def rank_logs(log_dir: Path, stream: str) -> dict[int, str]:
    return {int(p.parent.name): p.read_text() for p in log_dir.glob(f"*/attempt_0/*/{stream}.log")}


def rank_processes(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    return {int(c.environ()["RANK"]): c for c in psutil.Process(launcher.pid).children()
            if "RANK" in c.environ()}


def wait_for_steps(launcher, run_dir: Path, steps: int, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            pytest.fail(f"training did not reach step {steps}:\n{launcher.communicate()[0][-3000:]}")
        time.sleep(0.1)


def gone(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def end(launcher, procs) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    launcher.wait(timeout=60)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("victim", [1, 2], ids=["stopped-tp-peer-of-rank-0", "stopped-dp-peer-of-rank-0"])
def test_stopped_peer_ends_the_job_with_a_timeout(tmp_path, data, victim):
    """SIGSTOP one rank mid-run (megatron's TP groups are {0,1},{2,3}, DP groups {0,2},{1,3}): every other
    rank's collective times out, status.json says so, and they are gone within 3 × the timeout."""
    run_dir = tmp_path / "run"
    launcher = torchrun(SMALL + data["overrides"] + ["train.steps=100000", "train.save_final=false"], run_dir,
                        tmp_path / "logs")
    wait_for_steps(launcher, run_dir, 3)
    procs = rank_processes(launcher)
    procs[victim].suspend()
    stopped_at = time.monotonic()
    live = [p for r, p in procs.items() if r != victim]
    while not all(gone(p) for p in live) and time.monotonic() - stopped_at < 3 * TIMEOUT_S + 30:
        time.sleep(0.1)
    live_gone_after = time.monotonic() - stopped_at
    status = json.loads((run_dir / "status.json").read_text())
    end(launcher, procs.values())
    print(f"victim rank {victim}: live ranks gone {live_gone_after:.1f} s after SIGSTOP "
          f"(timeout {TIMEOUT_S:.0f} s)")
    assert live_gone_after < 3 * TIMEOUT_S
    assert (status["status"], status["exit_code"]) == ("failed", EXIT_PEER)
    assert status["error"].startswith(f"error: a collective waited longer than train.timeout_minutes ({TIMEOUT_S:g} s) "
                                      "for a peer rank (rank ")
    stderr = rank_logs(tmp_path / "logs", "stderr")
    for rank in procs:
        if rank != victim:
            lines = error_lines(stderr[rank])
            # a rank still in lost_peers' settle when torchrun's SIGTERM came said none (pretrain/runtime/lifecycle.py)
            assert len(lines) == 1, (rank, stderr[rank][-3000:])
            assert f"(rank {rank})" in lines[0] and "Traceback" not in stderr[rank]
    # A readable console: no rank warns about torch's older collective names (zero3d calls the ones the
    # installed torch offers), megatron's Apex/TE fallbacks, its CUDA-graph scope deprecation or its
    # CUDA_DEVICE_MAX_CONNECTIONS advice; rank 0 states those once, as a fact.
    noise = {rank: [n for n in CONSOLE_NOISE if n in text] for rank, text in stderr.items()}
    assert noise == {rank: [] for rank in procs}
    stdout = rank_logs(tmp_path / "logs", "stdout")
    missing = [m for m in ("apex", "transformer_engine") if importlib.util.find_spec(m) is None]
    assert [text.count("kernels: ") for _, text in sorted(stdout.items())] == [int(bool(missing)), 0, 0, 0]
    assert ("Apex not installed" in stdout[0], "Transformer Engine not installed" in stdout[0]) == (
        "apex" in missing, "transformer_engine" in missing)


@pytest.mark.timeout(400)
def test_rank_stuck_outside_collectives_is_ended_by_the_watchdog(tmp_path, data):
    """Rank 1's data loader hangs: its peers time out in their collectives; the watchdog ends rank 1 itself.
    A previous run's status.json (failed, exit 4) is cleared by rank 0 at the start: this run's failure
    is recorded first-come (not agreed), so a stale file would otherwise stand."""
    run_dir = tmp_path / "run"
    write_status(run_dir, "failed", "a previous run", 4, 7, EXIT_NUMERICAL, "error: a previous run's")
    launcher = torchrun(SMALL + data["overrides"] + ["train.steps=100000", "train.save_final=false"], run_dir,
                        tmp_path / "logs", env={"STUCK_RANK": "1", "STUCK_STEP": "3"},
                        script="tests/dist/stuck_loader_entry.py")
    wait_for_steps(launcher, run_dir, 3)
    hung_at = time.monotonic()
    procs = rank_processes(launcher)
    while not gone(procs[1]) and time.monotonic() - hung_at < 3 * TIMEOUT_S + 30:
        time.sleep(0.1)
    stuck_gone_after = time.monotonic() - hung_at
    end(launcher, procs.values())
    print(f"stuck rank 1 gone {stuck_gone_after:.1f} s after its last step (watchdog {2 * TIMEOUT_S:.0f} s)")
    assert stuck_gone_after < 3 * TIMEOUT_S
    (line,) = error_lines(rank_logs(tmp_path / "logs", "stderr")[1])
    assert line.startswith("error: no training progress for ") and "(rank 1, watchdog)" in line
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["exit_code"], status["status"]) == (EXIT_PEER, "failed") and status["reason"] != "a previous run"


@pytest.mark.timeout(400)
def test_input_error_on_two_ranks_is_one_line_from_rank_0(tmp_path, data):
    overrides, expected = make_input("tokenizer-not-sentencepiece", tmp_path, data)
    run_dir = tmp_path / "run"
    launcher = torchrun(SMALL + data["overrides"] + overrides + ["train.steps=2"], run_dir, tmp_path / "logs",
                        nproc=2)
    launcher.communicate(timeout=300)
    stderr = rank_logs(tmp_path / "logs", "stderr")
    assert sorted(stderr) == [0, 1]
    assert [len(error_lines(stderr[r])) for r in range(2)] == [1, 0]
    assert error_lines(stderr[0])[0].startswith(expected)
    assert not any("Traceback" in text for text in stderr.values())
    assert not run_dir.exists()  # a refused start writes nothing: the line and the code say it all
