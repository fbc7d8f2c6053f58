"""A restart refused for another model shape, vocabulary or tokenizer leaves the finished run's directory as
it was: config.json, status.json and every other file keep their bytes."""
import json
from pathlib import Path

import pytest

from test_crash_resume import REPO, Run, argv

TINY = ["train.save_final=true", "train.save_interval=0", "logging.straggler_factor=1000"]


def snapshot(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step run on one rank (status.json "ok"), and a second tokenizer of the same vocabulary."""
    import os
    from pretrain.config import DataConfig
    from pretrain.data.datasets import prepare_files
    root = tmp_path_factory.mktemp("refused")
    cache = root / "cache"
    data = [f"data.corpus={json.dumps(str(REPO / 'data/corpus.jsonl'))}", f"data.cache_dir={json.dumps(str(cache))}"]
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        run = Run(argv(root / "run", data, 2) + TINY, root / "logs", world=1)
        assert run.wait(300) == [0], run.text("err")
    finally:
        os.chdir(cwd)
    small = root / "small.jsonl"
    small.write_text("".join((REPO / "data/corpus.jsonl").read_text().splitlines(keepends=True)[:300]))
    other = prepare_files(DataConfig(corpus=str(small), cache_dir=str(root / "cache2")), 512).tokenizer_path
    assert json.loads((root / "run" / "status.json").read_text())["status"] == "ok"
    return {"root": root, "data": data, "other_tokenizer": other}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("change,named", [
    (["model.hidden_size=32"], "hidden_size: saved 64, now 32"),
    (["model.vocab_size=384"], "vocab_size: saved 512, now 384"),
    (["data.tokenizer_model={other}"], "tokenizer_sha256: saved '"),
], ids=["shape", "vocabulary", "tokenizer"])
def test_a_refused_restart_leaves_the_run_directory_byte_identical(finished_run, monkeypatch, change, named):
    monkeypatch.chdir(REPO)
    root, run_dir = finished_run["root"], finished_run["root"] / "run"
    before = snapshot(run_dir)
    change = [c.replace("{other}", json.dumps(str(finished_run["other_tokenizer"]))) for c in change]
    run = Run(argv(run_dir, finished_run["data"], 2) + TINY + change, root / "logs", world=1)
    assert run.wait(300) == [3], run.text("err")
    (line,) = [x for x in run.text("err").splitlines() if x.strip()]
    assert line.startswith("error: ") and "written for another model, tokenizer or data: " in line and named in line, line
    assert snapshot(run_dir) == before
