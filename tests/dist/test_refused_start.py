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


def cosine_lr(step: int, steps: int) -> float:
    """The learning rate of 0-based `step` for SMALL's optimizer (tiny.toml's lr 3e-3, min_lr 3e-4; 2 warmup steps),
    cosine to train.steps: written out here, not pretrain.schedule's."""
    import math
    lr, min_lr, warmup = 3e-3, 3e-4, 2
    if step < warmup:
        return lr * (step + 1) / warmup
    if step >= steps:  # past the decay's end (a decay of no steps too): min_lr
        return min_lr
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))


def restart(finished_run, monkeypatch, change: list, steps: int = 2, run_dir=None) -> tuple:
    """The finished run's own command again (its run directory, or `run_dir`), with `change`: (exit codes, stdout,
    the stderr lines)."""
    monkeypatch.chdir(REPO)
    root = finished_run["root"]
    run = Run(argv(run_dir or root / "run", finished_run["data"], steps) + TINY + change, root / "logs", world=1)
    codes = run.wait(300)
    return codes, run.text("out"), [x for x in run.text("err").splitlines() if x.strip()]


@pytest.mark.timeout(300)
def test_attention_te_without_transformer_engine_is_one_line_and_writes_nothing(finished_run, monkeypatch):
    """Kernel availability is a start check: 'te' where Transformer Engine is not importable (this CPU venv) is a
    config error in one line before any model is built, not an unexpected error after config.json was rewritten."""
    before = snapshot(finished_run["root"] / "run")
    codes, _, lines = restart(finished_run, monkeypatch, ['model.attention="te"'])
    assert codes == [2] and lines == ["error: model.attention = 'te' cannot run here: Transformer Engine is not "
                                      "importable (config): use 'auto', 'sdpa' or 'local'"], lines
    assert snapshot(finished_run["root"] / "run") == before


@pytest.mark.timeout(300)
def test_a_finished_run_says_so_and_writes_nothing(finished_run, monkeypatch):
    """The same command once more: one line, exit 0 (a requeued or repeated job of a finished run is no failure),
    nothing trained, no file of the run directory touched."""
    run_dir = finished_run["root"] / "run"
    before = snapshot(run_dir)
    codes, out, lines = restart(finished_run, monkeypatch, [])
    assert codes == [0] and lines == [], lines
    assert (f"{run_dir} is finished: step_00000002 is step 2 of train.steps = 2; nothing to train, its records left "
            "as they are (raise train.steps to train on, or give the run another logging.name)") in out.splitlines(), out
    assert "step 1/" not in out and snapshot(run_dir) == before and not (run_dir / "run.lock").exists()


@pytest.mark.timeout(300)
def test_more_steps_that_change_the_schedule_are_refused_unless_allowed(finished_run, monkeypatch, tmp_path):
    """train.steps 2 → 4 on resume moves the cosine's end: step 3 would train at another learning rate. Refused in one
    line naming it (exit 2, nothing written); with train.allow_schedule_change = true said in one line and trained on
    — a copy of the run, with a train.init_from the resume does not use, said too."""
    import shutil
    run_dir = finished_run["root"] / "run"
    before = snapshot(run_dir)
    new, old = f"{cosine_lr(2, 4):.6g}", f"{cosine_lr(2, 2):.6g}"  # 0-based step 2, the run's step 3
    assert new != old
    codes, _, lines = restart(finished_run, monkeypatch, [], steps=4)
    assert codes == [2] and lines == [
        f"error: resuming step_00000002 with train.steps 2 → 4 changes its learning-rate schedule: step 3 would train at "
        f"lr {new} instead of {old} (config): keep the checkpoint's values, or set train.allow_schedule_change = true "
        "to train on with the new schedule"], lines
    assert snapshot(run_dir) == before

    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    hf = tmp_path / "hf"  # an HF directory of this very model, which the resume must not load
    from pretrain.checkpoint.export import main as export_main
    assert export_main([str(copy / "checkpoints"), str(hf), "--format", "hf"]) == 0
    codes, out, lines = restart(finished_run, monkeypatch, ["train.allow_schedule_change=true",
                                                            f"train.init_from={json.dumps(str(hf))}"], 4, copy)
    assert codes == [0], lines
    said = out.splitlines()
    assert (f"train.steps 2 → 4 since step_00000002: the learning-rate schedule changes (step 3 would train at lr {new} "
            f"instead of {old}); train.allow_schedule_change = true") in said, out
    assert (f"train.init_from = '{hf}' is not used: this run resumes its own step_00000002 (train.resume = false would "
            "start from the HF weights again)") in said, out
    rows = [json.loads(x) for x in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][-2:] == [3, 4] and rows[-1]["train/lr"] == pytest.approx(cosine_lr(3, 4), rel=1e-12)


def holder(pid: int, started: float) -> dict:
    import socket
    return {"host": socket.gethostname(), "pid": pid, "pid_started": started, "job_id": None, "restart": 0,
            "job_name": None, "user": "someone", "since": 1.8e9, "token": "test"}


@pytest.mark.timeout(300)
def test_a_run_directory_a_live_process_holds_is_refused_before_any_data_work(finished_run, monkeypatch, tmp_path):
    """run.lock held by a live process (this test's own): the start is one line, exit 3, before the corpus is
    tokenized (a fresh data.cache_dir stays empty), and the holder's lock and every other file keep their bytes."""
    import os

    import psutil
    run_dir = finished_run["root"] / "run"
    lock = run_dir / "run.lock"
    lock.write_text(json.dumps(holder(os.getpid(), psutil.Process().create_time())))
    try:
        before = snapshot(run_dir)
        cache = tmp_path / "fresh-cache"
        codes, _, lines = restart(finished_run, monkeypatch, [f"data.cache_dir={json.dumps(str(cache))}"])
        assert codes == [3] and len(lines) == 1 and lines[0].startswith(
            f"error: run directory {run_dir} is in use: run.lock is held by pid {os.getpid()} on host ") and lines[0].endswith(
            f"(run directory lock): wait for that run to end; if it is gone (a lost node), remove {lock}"), lines
        assert snapshot(run_dir) == before and not (cache.exists() and any(cache.iterdir()))
    finally:
        lock.unlink()


@pytest.mark.timeout(300)
def test_a_stale_lock_of_a_process_gone_is_taken_over_and_released(finished_run, monkeypatch):
    """run.lock of a process that exited on this host (kill -9 leaves it so): taken over with one line, and released
    when the start ends, leaving the directory as it was before the dead process locked it."""
    import subprocess
    import time
    run_dir = finished_run["root"] / "run"
    before = snapshot(run_dir)
    gone = subprocess.Popen(["true"])
    gone.wait()
    (run_dir / "run.lock").write_text(json.dumps(holder(gone.pid, time.time())))
    codes, out, lines = restart(finished_run, monkeypatch, [])
    assert codes == [0] and lines == [], lines
    assert f"{run_dir / 'run.lock'}: took over the lock of pid {gone.pid} on host " in out and (
        ": its process is gone") in out, out
    assert "is finished" in out and snapshot(run_dir) == before
