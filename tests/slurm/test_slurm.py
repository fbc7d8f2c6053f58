"""Slurm launch path on a real single-node Slurm (slurm-wlm), plus the collector and run summaries."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm import collect, submit
from tests.slurm.jobs import wait_for

REPO = Path(__file__).resolve().parents[2]


def records(steps, tflops=lambda s: 10.0, **extra):
    return [{"step": s, "perf/tflops_per_gpu": tflops(s), "perf/tokens_per_s": 100.0 * s,
             "comm/total/elements": 5.0, "mem/max_allocated_bytes": 1000 * s, "train/loss": 10.0 - s, **extra}
            for s in range(1, steps + 1)]


def test_summary_medians_after_warmup_and_peaks_over_all_steps():
    recs = records(20, tflops=lambda s: 1.0 if s <= 5 else 30.0 + s % 3)
    summary = collect.summary_from_records(recs, warmup=5, world_size=400)
    assert summary["summary/tflops_per_gpu"] == 31.0
    assert summary["summary/pflops"] == pytest.approx(31.0 * 400 / 1000)
    assert summary["summary/measured_steps"] == 15 and summary["summary/steps"] == 20
    assert summary["summary/peak_mem_bytes"] == 20000 and summary["summary/final_loss"] == -10.0
    assert summary["summary/comm_elements_per_step"] == 5.0 and summary["summary/world_size"] == 400
    assert "summary/mfu" not in summary  # not logged on CPU: left out, not None
    short = collect.summary_from_records(records(3), warmup=10, world_size=4)
    assert short["summary/measured_steps"] == 3 and short["summary/warmup_only"]  # none past: all, flagged
    assert not summary["summary/warmup_only"]
    assert collect.summary_from_records([], warmup=10, world_size=4)["summary/steps"] == 0


def test_resumed_steps_count_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = records(3) + [dict(records(3)[1], **{"perf/tflops_per_gpu": 99.0})]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = collect.read_records(path)
    assert [r["step"] for r in got] == [1, 2, 3] and got[1]["perf/tflops_per_gpu"] == 99.0


def fake_run(root: Path, name: str, config: str, steps=0, log=None, status=None) -> Path:
    from pretrain.config import load_config
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(load_config(REPO / config).to_dict()))
    if steps:
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records(steps)))
    if log is not None:
        (run / "slurm-7.out").write_text(log)
    if status is not None:
        (run / "status.json").write_text(json.dumps(status))
    return run


def test_collector_rows_for_ok_oom_failed_and_missing_runs(tmp_path):
    z, b = "configs/paper/fig2_100B_zero.toml", "configs/paper/fig2_100B_baseline.toml"
    ok = fake_run(tmp_path, "ok", z, steps=100, status={"status": "ok", "reason": ""})
    oom = fake_run(tmp_path, "oom", b, steps=1, log="step 1\ntorch.OutOfMemoryError: CUDA out of memory. "
                   "Tried to allocate 2.00 GiB\n", status={"status": "failed", "reason": "exception"})
    crash = fake_run(tmp_path, "crash", z, steps=2, log="Traceback\nRuntimeError: NCCL timeout\n")
    limit = fake_run(tmp_path, "limit", z, steps=50,
                     log="slurmstepd: error: *** JOB 7 ON n1 CANCELLED AT 2026-01-01T00:00:00 DUE TO TIME LIMIT ***\n")
    never = fake_run(tmp_path, "never", z)
    rows = {r.name: collect.collect_run(r, warmup=10) for r in (ok, oom, crash, limit, never)}
    assert rows["ok"]["status"] == "ok" and rows["ok"]["tflops_per_gpu"] == 10.0
    assert rows["ok"]["pflops"] == pytest.approx(4.0) and rows["ok"]["gpus"] == 400
    assert (rows["ok"]["model"], rows["ok"]["system"], rows["ok"]["config"], rows["ok"]["mp"]) == (
        "100B", "zero", "C4", 16)
    h, padded = 8192, 51200  # 50257 padded to a multiple of 128 × TP 16; every weight and bias, untied output
    assert rows["ok"]["params"] == 125 * (12 * h * h + 13 * h) + 2 * h + 2 * padded * h + 1024 * h
    assert rows["oom"]["status"] == "oom" and "CUDA out of memory" in rows["oom"]["reason"]
    assert (rows["oom"]["system"], rows["oom"]["config"], rows["oom"]["gpus"]) == ("baseline", "Megatron", 384)
    assert rows["crash"]["status"] == "failed" and "2/100 steps" in rows["crash"]["reason"]
    assert "NCCL timeout" in rows["crash"]["reason"]
    assert rows["limit"]["status"] == "time_limit"
    assert rows["never"]["status"] == "missing"
    out = tmp_path / "results"
    assert collect.main([str(r) for r in (ok, oom, crash, limit, never)] + ["--out", str(out)]) == 0
    table = (out / "table.md").read_text()
    assert "| oom | torch.OutOfMemoryError" in table and ">38 TFLOP/s/GPU at 100B" in table
    assert (out / "scaling.png").stat().st_size > 10_000 and len((out / "table.csv").read_text().splitlines()) == 6


def test_plot_bars_never_overlap_and_the_legend_lists_what_is_drawn(tmp_path):
    z7, b7 = "configs/paper/fig7_1p5B_zero.toml", "configs/paper/fig7_1p38B_baseline.toml"
    runs = [fake_run(tmp_path, "a", "configs/paper/fig2_1p5B_zero.toml", steps=30, status={"status": "ok"}),
            fake_run(tmp_path, "b", z7, steps=30, status={"status": "ok"}),  # same model, same variant
            fake_run(tmp_path, "c", "configs/paper/fig7_13B_zero.toml", steps=5, status={"status": "ok"}),
            fake_run(tmp_path, "d", b7, steps=1, log="torch.OutOfMemoryError: CUDA out of memory.\n",
                     status={"status": "failed", "reason": "exception"})]
    rows = [collect.collect_run(r, warmup=10) for r in runs]
    assert [r["warmup_only"] for r in rows] == [False, False, True, True]
    assert "warm-up only: 5 logged step(s), none past --warmup 10" in rows[2]["reason"]
    keys, slots = collect.bar_slots(rows)
    assert keys.count(("1.5B", "")) == 1
    spans = sorted((x - w / 2, x + w / 2) for x, w in slots.values())
    assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))  # side by side, never on top
    _, labels = collect.plot(rows, tmp_path / "scaling.png")
    # no baseline bar is drawn (its only run is out of memory); the 13B point is no paper figure
    assert sorted(labels) == ["ZeRO (measured)", "median includes warm-up steps", "paper, approx"]
    assert [f for f in collect.PAPER_FIGURES if f[0] == 7 and f[2] == f[3] == 13] == []


def test_stop_warning_covers_a_step_and_the_checkpoint_write():
    from pretrain.config import load_config
    cfg = load_config(REPO / "configs/paper/fig2_100B_zero.toml")
    from analysis.estimate import gpt_param_count
    psi = 16 * gpt_param_count(125, 8192, 50257, 1024, tp=16)  # the whole model (16 TP slices)
    psi -= 15 * (125 * 6 * 8192 + 2 * 8192 + 1024 * 8192)  # per-layer biases and norms, final norm, positions: whole on every TP rank
    # each element once: fp16 parameters (2Ψ) + the fp32 master and Adam moments (12Ψ), any layout
    assert submit.checkpoint_bytes(cfg) == 14 * psi
    # the planner's step: its compute at Megatron-LM's V100 share (39 of 125 TFLOP/s; padded vocabulary 51200 at TP 16)
    # and the exposed TP all-reduces (the paper's ZeRO-100B: 38 TFLOP/s a GPU, over 30% of peak)
    tokens, h = 800 * 1024, 8192
    flops = 96 * tokens * 125 * h * h * (1 + 1024 / (6 * h)) + 6 * tokens * h * 51200
    assert flops / (400 * 39e12) < submit.step_seconds(cfg, 25) < 1.2 * flops / (400 * 39e12)
    write = submit.checkpoint_bytes(cfg) / 5e9  # cluster.checkpoint_write_gbps default
    assert submit.warning_seconds(cfg, 25) == math.ceil(2 * (write + submit.step_seconds(cfg, 25)) + 60)
    faster = load_config(REPO / "configs/paper/fig2_100B_zero.toml", ["cluster.checkpoint_write_gbps=1000"])
    assert submit.warning_seconds(faster, 25) < submit.warning_seconds(cfg, 25)
    assert submit.warning_seconds(load_config(REPO / "configs/tiny.toml"), 1) == submit.WARNING_FLOOR_S
    assert [submit.time_limit_seconds(t) for t in ("05:30:00", "1-00:00:00", "90", "10:30")] == [19800, 86400, 5400, 630]
    with pytest.raises(Exception, match="cluster.checkpoint_write_gbps = 0.0 must be > 0"):
        load_config(REPO / "configs/tiny.toml", ["cluster.checkpoint_write_gbps=0"])


def test_master_port_stays_below_the_ephemeral_range(monkeypatch):
    job = submit.build_job("configs/tiny.toml", [])
    for job_id in ("0", "12999", "29999", "987654"):
        env = dict(os.environ, ZERO3D_DRY_RUN="1", SLURM_JOB_ID=job_id, SLURM_SUBMIT_DIR=str(REPO))
        out = subprocess.run(["bash", str(REPO / submit.LAUNCHER), job.config_path], env=env, capture_output=True,
                             text=True, cwd=REPO).stdout
        port = int(re.search(r"MASTER_PORT=(\d+)", out).group(1))
        assert 20000 <= port < 30000 and port == 20000 + int(job_id) % 10000, out


def test_preflight_needs_the_jobs_task_count(capsys, tmp_path):
    assert submit.main(["--preflight", "--config", "configs/tiny.toml"]) == 2
    assert "--preflight needs --world-size N >= 1 (the job's task count), got None" in capsys.readouterr().err
    run_dir = tmp_path / "run"
    assert submit.main(["--preflight", "--world-size", "4", "--config", "configs/tiny.toml",
                        f"logging.run_dir={run_dir}"]) == 0
    assert not run_dir.exists()  # it writes nothing: rank 0 records config.json and job.json once started
    assert submit.main(["--preflight", "--world-size", "3", "--config", "configs/tiny.toml"]) == 2
    assert "world size 3 is not divisible by parallel.tensor × parallel.pipeline = 2" in capsys.readouterr().err


def test_cpu_ranks_get_no_device_verdict(capsys):
    import torch
    from pretrain.config import load_config
    from pretrain.memory_check import check_memory
    check_memory(load_config(REPO / "configs/tiny.toml"), 4, torch.device("cpu"), is_main=True, dp_per_node=1)
    out = capsys.readouterr().out
    assert out.rstrip().endswith("CPU run: no device memory check (the estimate is for H100, 80 GiB)")
    assert "fits" not in out


def test_launcher_dry_run_with_container(monkeypatch):
    job = submit.build_job("configs/tiny.toml", ["train.steps=2"], container="/img/zero3d.sqsh", requeue=True)
    monkeypatch.setenv("ZERO3D_CONTAINER_MOUNTS", "/data:/data")
    preview = submit.launch_preview(job)
    assert f"--container-mounts={REPO}:{REPO},/data:/data" in preview
    assert "--container-image=/img/zero3d.sqsh" in preview and f"--container-workdir={REPO}" in preview
    assert job.env == {"ZERO3D_CONTAINER": "/img/zero3d.sqsh", "ZERO3D_REQUEUE": "1", "ZERO3D_SINGLETON": "1"}
    assert "--requeue" in job.sbatch and "--dependency=singleton" in job.sbatch


# ---------------------------------------------------------------- a real Slurm


@pytest.mark.timeout(300)
def test_a_failing_job_is_reported_with_its_cause(cluster, tmp_path):
    """(A job that trains, in container mode, and one preempted and requeued: tests/slurm/test_preemption.py.)"""
    env = cluster.env(dict(os.environ, ZERO3D_PYTHON=sys.executable, WANDB_MODE="disabled"))
    run_dir = tmp_path / "broken"
    # a corpus that exists (a missing one is refused before it queues: tests/unit/test_submit_refusal.py) but is
    # not JSON: the job starts and fails on it
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("not json\n")
    cmd = [sys.executable, "slurm/submit.py", "--cpu", "--config", "configs/tiny.toml", "train.steps=4",
           "logging.wandb=false", f"logging.run_dir={run_dir}", f"data.corpus={corpus}",
           f"data.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip()
    state = wait_for(cluster, job_id, run_dir / "slurm-*.out")
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    # the start is refused on the corpus, which writes nothing into the run directory (Slurm's own log aside):
    # the batch script reads no status.json and exits with rank 0's code, the input-error code
    assert state["JobState"] == "FAILED" and state["ExitCode"] == "3:0" and "run status: none" in log, log
    assert sorted(p.name for p in run_dir.iterdir()) == [f"slurm-{job_id}.out"]
    line = (f"error: {corpus}:1: invalid JSON (Expecting value at column 1) (data): fix the file, or point "
            "data.corpus / data.blend at another")
    assert line in log.splitlines() and "Traceback" not in log, log
    row = collect.collect_run(run_dir, "configs/tiny.toml", warmup=1)  # (the TOML's 40 steps, not the override's 4)
    assert (row["status"], row["reason"]) == ("failed", f"no status.json; 0/40 steps logged; {line}")
