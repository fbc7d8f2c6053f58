"""Bad settings, paths and launch environments: `python -m pretrain` prints one line and exits with its code."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.errors import (EXIT_CONFIG, EXIT_INPUT, EXIT_NUMERICAL, EXIT_PEER, ConfigError, InputError,
                             NumericalError, PeerTimeoutError, peer_error)
from pretrain.runtime.status import write_status
from pretrain.runtime.watchdog import Watchdog

REPO = Path(__file__).resolve().parents[2]
TINY = ["model.num_layers=1", "logging.wandb=false", "logging.console=plain", "train.steps=2"]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_NODELIST", "SLURM_STEP_NODELIST", "ZERO3D_DEBUG")


def run_pretrain(args: list[str], env: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    """The real command, from the repository root, with only the given launcher variables set."""
    clean = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return subprocess.run([sys.executable, "-m", "pretrain", *args], cwd=REPO, env={**clean, **env},
                          capture_output=True, text=True, timeout=120)


def q(path) -> str:
    return json.dumps(str(path))


# (id, command-line arguments after --config configs/tiny.toml + TINY, environment, exit code, the line)
# {tmp} in arguments and the line is the test's tmp_path.
CASES = [
    ("ffn-negative", ["model.ffn_hidden_size=-8"], {}, EXIT_CONFIG,
     "error: model.ffn_hidden_size = -8 is invalid (config): must be > 0 (or unset: 4 × hidden_size)"),
    ("lr-inf", ["optimizer.lr=inf"], {}, EXIT_CONFIG,
     "error: optimizer.lr = inf is invalid (config): must be a finite number"),
    ("lr-nan", ["optimizer.lr=nan"], {}, EXIT_CONFIG,
     "error: optimizer.lr = nan is invalid (config): must be a finite number"),
    ("loss-scale-with-bf16", ["precision.dtype=\"bf16\"", "precision.initial_loss_scale=1024"], {}, EXIT_CONFIG,
     "error: precision.initial_loss_scale = 1024.0 has no effect with precision.dtype = 'bf16' (config): remove it, "
     "or set precision.dtype = \"fp16\" (dynamic loss scaling is fp16-only)"),
    ("hysteresis-with-fp32", ["precision.hysteresis=4"], {}, EXIT_CONFIG,
     "error: precision.hysteresis = 4 has no effect with precision.dtype = 'fp32' (config): remove it, "
     "or set precision.dtype = \"fp16\" (dynamic loss scaling is fp16-only)"),
    ("stage-5", ["zero.stage=5"], {}, EXIT_CONFIG,
     "error: zero.stage = 5 is invalid (config): valid values: 0, 1, 2, 3"),
    ("misspelt-key", ["model.hiden_size=3"], {}, EXIT_CONFIG,
     "error: unknown config key 'model.hiden_size' (did you mean 'hidden_size'?) (config): valid keys here: "),
    ("timeout-zero", ["train.timeout_minutes=0"], {}, EXIT_CONFIG,
     "error: train.timeout_minutes = 0.0 is invalid (config): must be at least 1 second (1/60)"),
    ("nonfinite-steps-zero", ["train.max_nonfinite_steps=0"], {}, EXIT_CONFIG,
     "error: train.max_nonfinite_steps = 0 is invalid (config): must be >= 1"),
    ("eps-zero", ["optimizer.eps=0"], {}, EXIT_CONFIG, "error: optimizer.eps = 0.0 is invalid (config): must be > 0"),
    ("heads-not-dividing", ["model.num_attention_heads=3"], {}, EXIT_CONFIG,
     "error: model.hidden_size = 128 is not divisible by model.num_attention_heads = 3 (config): choose a head count "
     "that divides the hidden size"),
    ("run-dir-is-a-file", ["logging.run_dir={tmp}/a_file"], {}, EXIT_CONFIG,
     "error: logging.run_dir = '{tmp}/a_file' is an existing file, not a directory (config): set logging.run_dir "
     "to a directory path (or remove the file)"),
    ("run-dir-under-a-file", ["logging.run_dir={tmp}/a_file/run"], {}, EXIT_CONFIG,
     "error: logging.run_dir = '{tmp}/a_file/run' lies under '{tmp}/a_file', which is a file (config): set "
     "logging.run_dir to a path under a directory"),
    ("save-dir-is-a-file", ["train.save_dir={tmp}/a_file"], {}, EXIT_CONFIG,
     "error: train.save_dir = '{tmp}/a_file' is an existing file, not a directory (config): "),
    ("no-data", ["~data.corpus"], {}, EXIT_CONFIG,
     "error: no data to train on: data.corpus, data.blend and data.train_blend are all unset (config): name it: "
     "data.blend = \"<prefix>\" (.bin/.idx written by python -m pretrain.preprocess), or data.corpus = \"<JSONL, "
     "Parquet or Arrow file or glob>\" (data/corpus.jsonl is the shipped demo corpus)"),
    ("corpus-missing", ["data.corpus={tmp}/none.jsonl"], {}, EXIT_INPUT,
     "error: data.corpus = '{tmp}/none.jsonl' does not exist (input files): point data.corpus at JSONL files"),
    ("corpus-is-a-directory", ["data.corpus={tmp}"], {}, EXIT_INPUT,
     "error: data.corpus = '{tmp}' is a directory (input files): "),
    ("corpus-glob-matches-nothing", ["data.corpus={tmp}/shards/*.jsonl.zst"], {}, EXIT_INPUT,
     "error: data.corpus = '{tmp}/shards/*.jsonl.zst' matches no file (input files): point data.corpus at JSONL"),
    ("tokenizer-missing", ["data.tokenizer_model={tmp}/none.model"], {}, EXIT_INPUT,
     "error: data.tokenizer_model = '{tmp}/none.model' does not exist (input files): point it at a sentencepiece"),
    ("blend-files-missing", ["~data.corpus", "data.blend={tmp}/tokens", "data.tokenizer_model={tmp}/a_file"], {}, EXIT_INPUT,
     "error: data.blend = '{tmp}/tokens.bin' does not exist (input files): {tmp}/tokens.bin is missing; run "
     "python -m pretrain.preprocess"),
    ("blend-without-tokenizer", ["~data.corpus", "data.blend={tmp}/tokens"], {}, EXIT_CONFIG,
     "error: data.blend / data.train_blend need data.tokenizer_model (config): name the tokenizer that made their "
     "token ids"),
    ("blend-weights-do-not-parse", ["~data.corpus", "data.blend=0.3 {tmp}/a 0.7", "data.tokenizer_model={tmp}/a_file"], {},
     EXIT_CONFIG, "error: data.blend = "),
    ("master-port-not-a-number", [], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, EXIT_INPUT,
     "error: MASTER_PORT='http' is not a port number (environment): set MASTER_PORT to an integer in 1..65535"),
    ("master-port-out-of-range", [], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, EXIT_INPUT,
     "error: MASTER_PORT='70000' is not a port number (environment): "),
    ("rank-not-a-number", [], {"RANK": "zero", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, EXIT_INPUT,
     "error: RANK='zero' is not an integer >= 0 (environment): launch with torchrun or srun"),
    ("world-size-zero", [], {"RANK": "0", "WORLD_SIZE": "0", "MASTER_PORT": "29500"}, EXIT_INPUT,
     "error: WORLD_SIZE='0' is not an integer >= 1 (environment): "),
    ("rank-outside-world", [], {"RANK": "5", "WORLD_SIZE": "4", "MASTER_PORT": "29500"}, EXIT_INPUT,
     "error: rank 5 is outside world size 4 (environment): RANK (SLURM_PROCID) must be below WORLD_SIZE"),
    ("master-addr-unresolvable", [], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500",
                                      "MASTER_ADDR": "no-such-host.invalid"}, EXIT_INPUT,
     "error: MASTER_ADDR='no-such-host.invalid' does not resolve"),
    ("world-size-not-matching-layout", [], {"RANK": "0", "WORLD_SIZE": "3", "MASTER_PORT": "29500"}, EXIT_CONFIG,
     "error: world size 3 is not divisible by parallel.tensor × parallel.pipeline = 2 (config): valid world sizes "
     "are multiples of 2"),
    ("slurm-ntasks-zero", [], {"SLURM_PROCID": "0", "SLURM_NTASKS": "0", "SLURM_NODELIST": "node1"}, EXIT_INPUT,
     "error: SLURM_NTASKS='0' is not an integer >= 1 (environment): "),
]


@pytest.mark.parametrize("overrides,env,code,line", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_input_gives_one_line_and_its_exit_code(tmp_path, overrides, env, code, line):
    (tmp_path / "a_file").write_text("not a directory\n")
    fill = lambda text: text.replace("{tmp}", str(tmp_path))  # noqa: E731
    args = ["--config", "configs/tiny.toml", *TINY, f"logging.run_dir={q(tmp_path / 'run')}",
            *[o.split("=", 1)[0] + "=" + q(fill(o.split("=", 1)[1])) if "{tmp}" in o else o for o in overrides]]
    out = run_pretrain(args, env, tmp_path)
    assert out.returncode == code, out.stderr
    assert out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(fill(line)), out.stderr  # one line, no traceback


@pytest.mark.parametrize("config,bad,code", [("configs/tiny.toml", ["optimizer.lr=inf"], EXIT_CONFIG),
                                             ("configs/tiny.toml", ["data.corpus={none}"], EXIT_INPUT),
                                             ("configs/tiny.toml", ["~data.corpus"], EXIT_CONFIG),
                                             ("configs/llama3_8b.toml", [], EXIT_CONFIG)],
                         ids=["config", "input", "no-data", "llama3-recipe-without-data"])
def test_a_refused_start_leaves_the_run_directory_byte_identical(tmp_path, config, bad, code):
    """A requeued or repeated command that is refused (a bad setting, a missing corpus, no data named: the Llama-3
    recipe as shipped) touches nothing: the previous run's status.json and config.json keep their bytes, and no file
    is added."""
    run_dir = tmp_path / "run"
    write_status(run_dir, "ok", "", 4, 10, 0)
    (run_dir / "config.json").write_text('{"model": {"num_layers": 48}}\n')
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    bad = [b.replace("{none}", q(tmp_path / "none.jsonl")) for b in bad]
    exit_file = tmp_path / "exit"  # outside the run directory: where slurm/launch.sbatch reads rank 0's code
    out = run_pretrain(["--config", config, f"logging.run_dir={q(run_dir)}", *bad],
                       {"ZERO3D_EXIT_FILE": str(exit_file)}, tmp_path)
    assert out.returncode == code, out.stderr
    if "~data.corpus" in bad or "llama3" in config:
        assert out.stderr.startswith("error: no data to train on: "), out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: "), out.stderr
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before
    assert exit_file.read_text() == f"{out.returncode}\n"


def test_debug_setting_adds_the_traceback(tmp_path):
    out = run_pretrain(["--config", "configs/tiny.toml", "model.ffn_hidden_size=-8"], {"ZERO3D_DEBUG": "1"}, tmp_path)
    assert out.returncode == EXIT_CONFIG
    assert out.stderr.startswith("Traceback (most recent call last):")
    assert out.stderr.strip().splitlines()[-1].startswith("error: model.ffn_hidden_size = -8 is invalid (config)")


def test_error_line_format_and_pickling():
    import pickle
    err = InputError("corpus 'x' does not exist", "data", "point data.corpus at a file")
    assert err.line() == "error: corpus 'x' does not exist (data): point data.corpus at a file"
    assert str(ConfigError("a = 1 is invalid; must be > 1")) == "a = 1 is invalid; must be > 1"
    assert ConfigError("a = 1 is invalid; must be > 1").line() == "error: a = 1 is invalid (config): must be > 1"
    back = pickle.loads(pickle.dumps(PeerTimeoutError("w", "rank 2", "f")))
    assert (type(back), back.line(), back.agreed) == (PeerTimeoutError, "error: w (rank 2): f", False)
    assert [e.exit_code for e in (ConfigError("x"), InputError("x"), NumericalError("x"), PeerTimeoutError("x"))] == [
        2, 3, 4, 5]


def test_collective_failures_are_peer_errors():
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 9000ms for recv operation")
    assert peer_error(gloo, 3, 9.0).line().startswith(
        "error: a collective waited longer than train.timeout_minutes (9 s) for a peer rank (rank 3): ")
    gone = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242")
    assert peer_error(gone, 1, 9.0).exit_code == EXIT_PEER
    assert peer_error(RuntimeError("shape mismatch"), 0, 9.0) is None
    assert peer_error(ValueError("timed out"), 0, 9.0) is None


def test_first_failure_wins_and_final_status_replaces(tmp_path):
    assert write_status(tmp_path, "failed", "cause", 4, 3, EXIT_PEER, "error: cause", first=True)
    assert not write_status(tmp_path, "failed", "consequence", 4, 3, EXIT_PEER, "error: later", first=True)
    assert json.loads((tmp_path / "status.json").read_text())["reason"] == "cause"
    write_status(tmp_path, "failed", "agreed", 4, 3, EXIT_NUMERICAL, "error: agreed")
    assert json.loads((tmp_path / "status.json").read_text())["exit_code"] == EXIT_NUMERICAL
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]  # no temporary file left


def test_watchdog_fires_without_beats_and_not_while_beating():
    import threading
    import time
    fired = threading.Event()
    with Watchdog(0.5, lambda idle: fired.set()) as dog:
        for _ in range(10):
            dog.beat()
            time.sleep(0.1)
        assert not fired.is_set()
        assert fired.wait(5.0)


def test_unexpected_error_exits_1_with_its_traceback_then_the_line():
    """docs/exit-codes.md: code 1 is an unexpected error, and its traceback is always shown (no debug)."""
    import io

    from pretrain.runtime.status import report

    def buggy():
        raise KeyError("no such key")

    try:
        buggy()
    except KeyError as err:
        stream = io.StringIO()
        code = report(err, rank=2, timeout_s=60.0, debug=False, stream=stream)
    lines = stream.getvalue().splitlines()
    assert code == 1
    assert lines[0] == "Traceback (most recent call last):" and any("in buggy" in line for line in lines)
    assert lines[-1].startswith("error: unexpected KeyError: 'no such key' (rank 2): this is a bug")


def test_a_collective_timeout_outranks_a_lost_connection_recorded_just_before_it(tmp_path):
    """A rank that timed out on a stopped peer (the cause) and exits can reach another rank as a lost
    connection, which may be recorded a moment before the timed-out rank's own status: the timeout replaces
    it; a timeout recorded first stays; a second lost connection never replaces the first."""
    from pretrain.runtime.status import record_failure
    lost = RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500")
    timeout = RuntimeError("[gloo] Timed out waiting 15000ms for recv operation to complete")

    def error_after(*records):
        run_dir = tmp_path / str(len(list(tmp_path.iterdir())))
        for rank, err in records:
            record_failure(err, run_dir, rank, 4, 7, 15.0)
        return json.loads((run_dir / "status.json").read_text())["error"]

    assert error_after((0, lost), (3, timeout)).startswith(
        "error: a collective waited longer than train.timeout_minutes (15 s) for a peer rank (rank 3)")
    assert error_after((3, timeout), (0, lost)).startswith("error: a collective waited longer")
    assert error_after((1, lost), (0, lost)).startswith(
        "error: a peer rank exited or lost its connection during a collective (rank 1)")
    assert "(rank 1)" in error_after((1, timeout), (2, timeout))  # among causes, the first stays
