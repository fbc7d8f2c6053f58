"""Messages that name what is wrong and what is valid: sweep figures, generator output, relative paths, the stop line."""
import shutil
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from pretrain.__main__ import main  # noqa: E402
from slurm import sweep  # noqa: E402

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "ZERO3D_DEBUG")


def test_sweep_names_the_valid_figures(capsys):
    assert sweep.main(["--figure", "9", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--figure 9 is invalid" in err and "valid figures: 2, 3, 4, 5, 6, 7" in err


def test_generator_writes_only_where_told(tmp_path, capsys, monkeypatch):
    sys.path.insert(0, str(REPO / "configs"))
    import generate_paper
    committed = tmp_path / "paper"  # a copy stands in for configs/paper: a regression must not rewrite the repo
    shutil.copytree(REPO / "configs/paper", committed)
    monkeypatch.setattr(generate_paper, "DEFAULT_OUT", committed)
    before = {p.name: p.read_text() for p in committed.glob("*.toml")}
    with pytest.raises(SystemExit) as exit_:
        generate_paper.main(["--gpus-per-node", "8"])
    assert exit_.value.code == 2 and "--out is required" in capsys.readouterr().err
    assert {p.name: p.read_text() for p in committed.glob("*.toml")} == before
    assert generate_paper.main(["--check"]) == 0  # the committed set still matches
    assert generate_paper.main(["--gpus-per-node", "8", "--out", str(tmp_path / "p8")]) == 0
    assert len(list((tmp_path / "p8").glob("fig*.toml"))) == 56


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


def test_relative_data_path_says_where_it_resolved(tmp_path, monkeypatch, clean_env, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["--config", str(REPO / "configs/tiny.toml"), f"logging.run_dir=\"{tmp_path / 'run'}\""])
    err = capsys.readouterr().err
    assert code == 3 and f"'data/corpus.jsonl' does not exist (relative to the working directory {tmp_path})" in err


def test_a_signal_stop_prints_one_line_on_rank_0(tmp_path, monkeypatch, clean_env, capsys):
    monkeypatch.chdir(REPO)
    fake = types.ModuleType("pretrain.train")
    fake.train = lambda cfg, launch, job: {"stopped_early": True, "end_step": 3, "record": {}}
    monkeypatch.setitem(sys.modules, "pretrain.train", fake)
    monkeypatch.setitem(sys.modules, "pretrain.runtime.layout", types.SimpleNamespace(destroy_layout=lambda: None))
    code = main(["--config", "configs/tiny.toml", f"logging.run_dir=\"{tmp_path / 'run'}\"", "train.steps=6",
                 "parallel.tensor=1"])
    err = capsys.readouterr().err
    assert code == 75
    assert err == ("stopped by a signal (SIGINT/SIGUSR1/SIGTERM) after step 3 of 6: checkpoint step_00000003 saved, "
                   "status.json \"interrupted\"; run the same command to resume\n")
