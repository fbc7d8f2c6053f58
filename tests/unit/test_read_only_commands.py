"""Read-only commands (--estimate, --print-config) and errors before start never touch a finished run's record."""
import json
from pathlib import Path

import pytest

from pretrain.__main__ import main
from pretrain.errors import EXIT_CONFIG, EXIT_INPUT

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "ZERO3D_DEBUG")
FINISHED = {"status": "ok", "reason": "finished", "world_size": 4, "steps": 40, "exit_code": 0, "error": ""}


@pytest.fixture
def finished_run(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "status.json").write_text(json.dumps(FINISHED))
    return run_dir


def listing(run_dir: Path) -> dict:
    return {p.name: p.read_bytes() for p in run_dir.iterdir()}


@pytest.mark.parametrize("bad,flag", [("optimizer.lr=inf", "--estimate"), ("model.ffn_hidden_size=-8", "--print-config"),
                                      ("parallel.tensor=3", "--estimate"), ("", "--print-config"), ("", "--estimate")])
def test_read_only_commands_write_nothing(finished_run, bad, flag, capsys):
    before = listing(finished_run)
    code = main(["--config", "configs/tiny.toml", f"logging.run_dir={json.dumps(str(finished_run))}",
                 *([bad] if bad else []), flag])
    assert code == (EXIT_CONFIG if bad else 0), capsys.readouterr().err
    assert listing(finished_run) == before


@pytest.mark.parametrize("bad,code", [("optimizer.lr=inf", EXIT_CONFIG), ("data.corpus=\"/no/such.jsonl\"", EXIT_INPUT)])
def test_errors_before_start_keep_a_finished_runs_status(finished_run, bad, code, capsys):
    assert main(["--config", "configs/tiny.toml", f"logging.run_dir={json.dumps(str(finished_run))}", bad]) == code
    assert json.loads((finished_run / "status.json").read_text()) == FINISHED


def test_estimate_that_does_not_fit_exits_like_the_guard(finished_run, capsys):
    """1 means "unexpected error"; a layout that does not fit is refused as a config error (2), as the guard does."""
    code = main(["--config", "configs/tiny.toml", "cluster.gpu_memory_gb=0.001", "--estimate"])
    assert code == EXIT_CONFIG


def test_toml_given_without_config_flag_is_hinted(finished_run, capsys):
    assert main(["configs/tiny.toml"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean --config configs/tiny.toml?" in err


def test_config_directory_is_named_a_directory(finished_run, capsys):
    assert main(["--config", "configs/paper", "--print-config"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "'configs/paper' is a directory" in err and "--config configs/paper/fig" in err
