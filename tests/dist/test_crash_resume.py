"""Nothing lost: a run killed (-9) or interrupted (SIGINT) at random moments resumes from the newest save
every rank had written, and continues the uninterrupted run's losses exactly; a complete .tmp left by a
crash is published at start-up, an incomplete one removed, each with its line."""
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

import ranks  # noqa: F401 - megatron imported before the forks below
from local_ranks import free_port

REPO = Path(__file__).resolve().parents[2]
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
         "model.vocab_size=512", "train.micro_batch_size=2", "train.global_batch_size=8", "train.eval_interval=0",
         "logging.wandb=false", "logging.console=plain", "optimizer.warmup_steps=2", "parallel.tensor=1",
         "zero.stage=2", "train.save_interval=2", "train.async_save=true", "train.keep_checkpoints=3",
         "train.save_final=false", "train.timeout_minutes=0.5", "logging.straggler_factor=1000"]
KILLS = 12  # random interruptions, alternately kill -9 of one rank and SIGINT of every rank


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    from pretrain.config import DataConfig
    from pretrain.data.datasets import prepare_files
    cache = tmp_path_factory.mktemp("data")
    prepare_files(DataConfig(corpus=str(REPO / "data/corpus.jsonl"), cache_dir=str(cache)), vocab_size=512)
    return [f"data.corpus={json.dumps(str(REPO / 'data/corpus.jsonl'))}", f"data.cache_dir={json.dumps(str(cache))}"]


def _rank_entry(rank: int, world: int, port: int, argv: list, log_dir: str) -> None:
    """`python -m pretrain argv` as one rank of `world`: the entry point's main(), its stdout/stderr to files."""
    import sys
    for fd, stream in ((1, "out"), (2, "err")):
        os.dup2(os.open(f"{log_dir}/rank{rank}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
    # pytest's capture replaced sys.stdout/stderr in this (forked) process: write to the files instead
    sys.stdout, sys.stderr = open(1, "w", buffering=1, closefd=False), open(2, "w", buffering=1, closefd=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    torch.set_num_threads(1)
    from pretrain.__main__ import main
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Run:
    """The ranks of one attempt, forked from this process (megatron already imported)."""

    def __init__(self, argv: list, log_dir: Path, world: int = 2):
        log_dir.mkdir(parents=True, exist_ok=True)
        for f in log_dir.glob("rank*"):
            f.unlink()
        self.log_dir, port = log_dir, free_port()
        ctx = mp.get_context("fork")
        self.procs = [ctx.Process(target=_rank_entry, args=(r, world, port, argv, str(log_dir)), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def signal_all(self, sig) -> None:
        for p in self.procs:
            if p.is_alive():
                os.kill(p.pid, sig)

    def kill_one(self, rank: int) -> None:
        """kill -9 one rank; the launcher then kills the others (torchrun and srun --kill-on-bad-exit do)."""
        os.kill(self.procs[rank].pid, signal.SIGKILL)
        self.signal_all(signal.SIGKILL)
        self.wait()

    def wait(self, timeout: float = 120.0) -> list:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
        if any(p.is_alive() for p in self.procs):
            self.signal_all(signal.SIGKILL)
            pytest.fail(f"ranks still running after {timeout} s:\n{self.text('err')}")
        return [p.exitcode for p in self.procs]

    def text(self, stream: str, rank: int = 0) -> str:
        path = self.log_dir / f"rank{rank}.{stream}"
        return path.read_text() if path.exists() else ""


def complete_saves(save_dir: Path, world: int = 2) -> list[int]:
    """The steps whose save is on disk on every rank (README, checkpoints): published step directories,
    and .tmp directories holding checkpoint.json (the publication began) or pending.json and every rank's
    written/rank_<r>.json."""
    steps = []
    for d in save_dir.glob("step_*"):
        if d.name.endswith(".tmp") and not d.name.endswith(".old.tmp"):
            if (d / "checkpoint.json").is_file() or (d / "pending.json").is_file() and all(
                    (d / "written" / f"rank_{r:05d}.json").is_file() for r in range(world)):
                steps.append(int(d.name[5:13]))
        elif d.is_dir() and (d / "checkpoint.json").is_file():
            steps.append(int(d.name[5:13]))
    return sorted(steps)


def records(run_dir: Path) -> list[dict]:
    """The records of the lines written whole so far: a read while a rank appends may end in the middle of that
    line's write (seen: '{"step": 42, "time": 1795947921'), which a later read has whole."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines()]


def wait_until(predicate, run: Run, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline or not all(p.is_alive() for p in run.procs):
            run.signal_all(signal.SIGKILL)
            pytest.fail(f"{what} did not happen:\n{run.text('err')}{run.text('err', 1)}")
        time.sleep(0.01)


def argv(run_dir: Path, data: list, steps: int) -> list:
    return ["--config", "configs/tiny.toml", *SMALL, *data, f"train.steps={steps}",
            f"logging.run_dir={json.dumps(str(run_dir))}"]


@pytest.mark.timeout(900)
def test_random_kills_and_interrupts_resume_from_the_newest_written_save(tmp_path, data_cache, monkeypatch):
    """12 interruptions at random moments after a save was written (alternately kill -9 of a random rank and
    SIGINT of every rank); every start resumes from the newest save written on every rank, and every step
    any attempt logged equals the uninterrupted run's. train.steps is far away in every run (the same LR
    schedule and sample order), and the uninterrupted run is stopped once it has passed the chain."""
    monkeypatch.chdir(REPO)
    steps, chain, whole = 1000, tmp_path / "chain", tmp_path / "whole"
    rng, resumed_at, save_dir, t0 = random.Random(34), 0, chain / "checkpoints", time.monotonic()
    for attempt in range(KILLS + 1):
        run = Run(argv(chain, data_cache, steps), tmp_path / "logs")
        # the start-up line names where it continues: the newest save on disk at the last interruption
        wait_until(lambda: "resumed from" in run.text("out") or "no checkpoint in" in run.text("out"), run,
                   what=f"attempt {attempt}'s start-up line")
        said = [line for line in run.text("out").splitlines() if "resumed from" in line or "no checkpoint" in line]
        assert said == ([f"no checkpoint in {save_dir}: starting at step 1"] if resumed_at == 0 else
                        [f"resumed from step_{resumed_at:08d} (saved at layout tensor 1 × pipeline 1 × data 2, "
                         f"stage 2): continuing at step {resumed_at + 1}"]), (attempt, said)
        if attempt == KILLS:
            run.signal_all(signal.SIGKILL)
            run.wait()
            break
        # a random moment after a save newer than the resume point has been written by every rank:
        # 0-3 logged steps later, and a random fraction of a step
        wait_until(lambda: max(complete_saves(save_dir), default=0) > resumed_at, run,
                   what=f"attempt {attempt}'s first save")
        logged = len(records(chain)) + rng.randrange(4)
        wait_until(lambda: len(records(chain)) >= logged, run, what=f"attempt {attempt}'s steps")
        time.sleep(rng.uniform(0.0, 0.1))
        if attempt % 2 == 0:
            run.kill_one(rng.randrange(2))
            newest = max(complete_saves(save_dir))
        else:
            run.signal_all(signal.SIGINT)
            assert run.wait() == [75, 75], (attempt, run.text("err"))
            status = json.loads((chain / "status.json").read_text())
            newest = int((save_dir / "latest").read_text()[5:13])
            assert (status["status"], status["steps"]) == ("interrupted", newest), status
            stopped = [line for line in run.text("err").splitlines() if line.strip()]
            assert stopped == [f"stopped by a signal (SIGINT/SIGUSR1/SIGTERM) after step {newest} of {steps}: "
                               f"checkpoint step_{newest:08d} saved, status.json \"interrupted\"; run the same "
                               "command to resume"], stopped
        assert newest > resumed_at
        print(f"attempt {attempt}: {'kill -9' if attempt % 2 == 0 else 'SIGINT'}, resumable from step {newest} "
              f"({time.monotonic() - t0:.1f} s)")
        resumed_at = newest

    got = records(chain)
    last = max(r["step"] for r in got)
    reference = Run(argv(whole, data_cache, steps), tmp_path / "logs-whole")
    wait_until(lambda: len(records(whole)) >= last, reference, timeout=600, what="the uninterrupted run's steps")
    reference.signal_all(signal.SIGKILL)
    reference.wait()
    expected = {r["step"]: r["train/loss"] for r in records(whole)}
    assert {r["step"] for r in got} == set(range(1, last + 1))
    wrong = [(r["step"], r["train/loss"], expected[r["step"]]) for r in got if r["train/loss"] != expected[r["step"]]]
    assert wrong == []  # every logged step of every attempt equals the uninterrupted run, bit for bit
    print(f"{KILLS} interruptions, {len(got)} records of steps 1-{last}, all equal ({time.monotonic() - t0:.1f} s)")


def _crash_in_write(rank: int, world: int, port: int, argv_: list, log_dir: str, phase: str) -> None:
    """A rank whose writer thread is killed at `phase` of the save of step 4: "before-record" (its files
    written, its record not: an incomplete save) or "after-record" (every part on disk, not yet published)."""
    import pretrain.checkpoint.checkpointer as ckpt
    original = ckpt.written_record

    def record_then_maybe_die(tmp, r, files):
        if tmp.name == "step_00000004.tmp":
            if phase == "before-record" and r == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            original(tmp, r, files)
            if phase == "after-record":  # every rank's record lands; the job dies before the save is published
                while not all((tmp / "written" / f"rank_{k:05d}.json").is_file() for k in range(world)):
                    time.sleep(0.01)  # (this thread not finished: the loop cannot publish meanwhile)
                os.kill(os.getpid(), signal.SIGKILL)
            return
        original(tmp, r, files)
    ckpt.written_record = record_then_maybe_die
    _rank_entry(rank, world, port, argv_, log_dir)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("phase,resumes", [("before-record", 2), ("after-record", 4)])
def test_a_crash_during_or_after_the_write(tmp_path, data_cache, monkeypatch, phase, resumes):
    """Killed while step 4 is being written: the previous save resumes and the .tmp is removed; killed
    after every rank wrote it but before it was published: start-up publishes it and resumes from it."""
    monkeypatch.chdir(REPO)
    run_dir, steps = tmp_path / "run", 6
    whole = tmp_path / "whole"
    reference = Run(argv(whole, data_cache, steps), tmp_path / "logs-whole")
    assert reference.wait(300) == [0, 0], reference.text("err")
    expected = {r["step"]: r["train/loss"] for r in records(whole)}
    log_dir, port = tmp_path / "logs", free_port()
    log_dir.mkdir()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_crash_in_write, args=(r, 2, port, argv(run_dir, data_cache, steps), str(log_dir),
                                                       phase), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 300
    while all(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.01)
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join()
    save_dir = run_dir / "checkpoints"
    assert (save_dir / "latest").read_text() == "step_00000002\n"
    assert (save_dir / "step_00000004.tmp").is_dir() and not (save_dir / "step_00000004").exists()
    assert complete_saves(save_dir) == ([2] if phase == "before-record" else [2, 4])
    # rank 1 died before its record; rank 0, stopped a moment later, may not have written its own yet either
    written = save_dir / "step_00000004.tmp" / "written"
    unfinished = [k for k in range(2) if not (written / f"rank_{k:05d}.json").is_file()]
    assert unfinished in ([1], [0, 1]) if phase == "before-record" else unfinished == []

    run = Run(argv(run_dir, data_cache, steps), tmp_path / "logs2")
    assert run.wait(300) == [0, 0], run.text("err")
    out = run.text("out").splitlines()
    if phase == "before-record":
        (line,) = [x for x in out if x.startswith("removed step_00000004.tmp")]
        first = unfinished[0]  # the first rank in order whose part is missing
        assert line == (f"removed step_00000004.tmp: an interrupted save that cannot be resumed: rank {first}'s part was "
                        f"not finished (written/rank_{first:05d}.json is missing)")
    else:
        assert ("published step_00000004 from step_00000004.tmp: a save every rank had finished writing before the "
                "run was interrupted") in out
    assert [x for x in out if x.startswith("resumed from")][0].startswith(f"resumed from step_{resumes:08d} ")
    assert not list(save_dir.glob("*.tmp"))
    resumed = [r for r in records(run_dir)][-(steps - resumes):]
    assert [(r["step"], r["train/loss"]) for r in resumed] == [(s, expected[s]) for s in range(resumes + 1, steps + 1)]


@pytest.mark.timeout(600)
def test_a_truncated_tmp_is_removed_and_a_complete_one_published(tmp_path, data_cache, monkeypatch):
    """The .tmp of a save every rank wrote (published at the next step), copied back as a crash would have
    left it: with every file whole it is published and resumed; with one file cut short, removed."""
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    # a 4-step run with saves at 2 and 4; the .tmp at 4 rebuilt from the published step_4 (the same bytes)
    first = Run(argv(run_dir, data_cache, 4) + ["train.save_final=true"], tmp_path / "logs")
    assert first.wait(300) == [0, 0], first.text("err")
    save_dir = run_dir / "checkpoints"
    manifest = json.loads((save_dir / "step_00000004" / "checkpoint.json").read_text())
    keep = tmp_path / "step4"
    shutil.copytree(save_dir / "step_00000004", keep)
    for truncate in (True, False):
        shutil.rmtree(save_dir / "step_00000004", ignore_errors=True)
        tmp = save_dir / "step_00000004.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(keep, tmp)
        (save_dir / "latest").write_text("step_00000002\n")
        (tmp / "checkpoint.json").unlink()
        files = manifest["files"]
        (tmp / "pending.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "files"}))
        (tmp / "written").mkdir()
        for r in range(2):
            mine = {n: rec for n, rec in files.items() if f"rank_{r:05d}" in n or n.startswith(f"__{r}_")
                    or (r == 0 and n == ".metadata")}
            (tmp / "written" / f"rank_{r:05d}.json").write_text(json.dumps({"rank": r, "files": mine}))
        if truncate:
            victim = tmp / "__1_0.distcp"
            victim.write_bytes(victim.read_bytes()[:-7])
        run = Run(argv(run_dir, data_cache, 4) + ["train.save_final=true"], tmp_path / "logs")
        assert run.wait(300) == [0, 0], run.text("err")
        out = run.text("out").splitlines()
        if truncate:
            assert ("removed step_00000004.tmp: an interrupted save that cannot be resumed: __1_0.distcp is missing "
                    "or not at its recorded size") in out, out
            assert ("resumed from step_00000002 (saved at layout tensor 1 × pipeline 1 × data 2, stage 2): continuing "
                    "at step 3") in out, out
        else:
            assert ("published step_00000004 from step_00000004.tmp: a save every rank had finished writing before "
                    "the run was interrupted") in out, out
            # the published save is the run's last step: the start resumes it and finds the run finished
            assert (f"{run_dir} is finished: step_00000004 is step 4 of train.steps = 4; nothing to train, its "
                    "records left as they are (raise train.steps to train on, or give the run another "
                    "logging.name)") in out, out


def _watching_publication(rank: int, world: int, port: int, argv_: list, log_dir: str) -> None:
    """Before each step: wait until this rank's part of the pending save is written, then note what `latest`
    names (rank 0, into publications.txt). The step then reports "written" on every rank."""
    import pretrain.train as loop
    real = loop.one_step

    def one_step(run, step, *args, **kwargs):
        while run.checkpoints._pending is not None and not run.checkpoints.written():
            time.sleep(0.01)
        if rank == 0:
            latest = run.checkpoints.save_dir / "latest"
            with open(f"{log_dir}/publications.txt", "a") as f:
                f.write(f"{step + 1} {latest.read_text().strip() if latest.exists() else '-'}\n")
        return real(run, step, *args, **kwargs)
    loop.one_step = one_step
    _rank_entry(rank, world, port, argv_, log_dir)


@pytest.mark.timeout(300)
def test_an_async_save_is_published_by_the_step_after_it_is_written(tmp_path, data_cache, monkeypatch):
    """Saves at steps 2 and 4 (asynchronous), no next save to wait for them: each is `latest` from the step
    after its write finished, not only at the next save or the end of the run."""
    monkeypatch.chdir(REPO)
    run_dir, log_dir, port = tmp_path / "run", tmp_path / "logs", free_port()
    log_dir.mkdir()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_watching_publication, args=(r, 2, port, argv(run_dir, data_cache, 6), str(log_dir)),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
    assert [p.exitcode for p in procs] == [0, 0], (log_dir / "rank0.err").read_text()
    seen = dict(line.split() for line in (log_dir / "publications.txt").read_text().splitlines())
    # what `latest` named as each step began: step 3 reported save 2 written, so step 4 begins with it
    assert seen == {"1": "-", "2": "-", "3": "-", "4": "step_00000002", "5": "step_00000002",
                    "6": "step_00000004"}, seen
