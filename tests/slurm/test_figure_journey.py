"""Figure 2 scaled down (slurm/sweep.py --cpu --shrink) through a real Slurm, collected into table and plot."""
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm import sweep
from tests.slurm.jobs import wait_for

REPO = Path(__file__).resolve().parents[2]
# Submitted to the 2-node local cluster (`cluster2`): each row is one node × 2 ranks (TP inside the node as the
# paper's rows keep it), so Slurm places the jobs on both nodes, two at a time. NODES = 2 spans them, at 2× the CPU.
NODES, RANKS_PER_NODE, SHRINK, STEPS, WARMUP = 1, 2, 24, 3, 1
FIG2 = ["1p5B", "8B", "20B", "40B", "60B", "80B", "100B", "120B", "140B", "170B"]  # reproduction-configs.csv
# Two rows through Slurm (the smallest, TP 1; the 100B, TP 2), both systems: 4 of the figure's 20 jobs, two at a time
# on the two nodes (each job is 3 Python processes importing torch: the other 16 rows would add 16 × ~17 s of CPU and
# nothing new; a third, the 170B at TP 2 again, was dropped for that).
SIZES = ["1.5B", "100B"]


def run_sweep(*args, env=None):
    return subprocess.run([sys.executable, "slurm/sweep.py", "--figure", "2", *args], capture_output=True,
                          text=True, cwd=REPO, env=env)


def test_the_shrink_rule_on_the_100B_row():
    from pretrain.config import load_config
    cfg = load_config(REPO / "configs/paper/fig2_100B_zero.toml")  # 125 × 8192, 64 heads, TP 16, micro 32
    plan = sweep.shrink_plan(cfg, 24, nodes=2, ranks_per_node=2)
    assert plan == {"model.num_layers": 6,  # ⌈125/24⌉
                    "model.num_attention_heads": 4,  # ⌈64/24⌉ = 3, up to a multiple of TP gcd(16, 2) = 2
                    "model.hidden_size": 344,  # ⌈8192/(24·4)⌉ = 86 heads' worth of 4
                    "model.seq_length": 43, "model.vocab_size": 2095,  # ⌈1024/24⌉, ⌈50257/24⌉
                    "parallel.tensor": 2, "train.micro_batch_size": 2,  # ⌈32/24⌉
                    "train.global_batch_size": 4,  # 2 per micro-batch × DP (2 × 2 ranks / TP 2)
                    "cluster.nodes": 2, "cluster.gpus_per_node": 2, "paper.shrink": 24}
    one = sweep.shrink_plan(load_config(REPO / "configs/paper/fig2_1p5B_zero.toml"), 24, nodes=1, ranks_per_node=2)
    assert (one["parallel.tensor"], one["model.num_attention_heads"], one["model.hidden_size"]) == (1, 1, 67)
    assert one["train.global_batch_size"] == 2  # TP 1: both ranks are DP
    from pretrain.config import ConfigError
    with pytest.raises(ConfigError, match=r"^paper.shrink = 0 is invalid; must be >= 1 \(1: the paper's shapes\)$"):
        load_config(REPO / "configs/paper/fig2_100B_zero.toml", ["paper.shrink=0"])


def test_dry_run_lists_every_row_and_bad_values_get_one_line(capsys):
    assert sweep.main(["--figure", "2", "--cpu", "--shrink", "24", "--dry-run"]) == 0
    out = capsys.readouterr().out
    names = re.findall(r"^(fig2_\w+): (?:\w+=\S+ )*sbatch ", out, re.M)  # the job's variables, then sbatch
    assert sorted(names) == sorted(f"fig2_{s}_{k}" for s in FIG2 for k in ("zero", "baseline"))
    assert "--nodes=2 --ntasks-per-node=2" in out and "20 jobs (dry run" in out
    # ÷32 ties 80B and 100B baseline: 4 layers × 256 each (⌈100/32⌉ = ⌈125/32⌉), vocab 1571 padded to 1792
    tie = 4 * (12 * 256 ** 2 + 13 * 256) + 2 * 256 + 2 * 1792 * 256 + 32 * 256
    bad = {("--cpu", "--shrink", "32"): f"fig2_80B_baseline (Ψ = {tie:,}) would not be smaller than "
                                        f"fig2_100B_baseline (Ψ = {tie:,})",
           ("--cpu", "--shrink", "0"): "--shrink 0 is invalid; must be an integer >= 1",
           ("--shrink", "8"): "--shrink 8 needs --cpu",
           ("--cpu", "--shrink", "8", "--nodes", "0"): "--nodes 0 is invalid; must be an integer >= 1",
           ("--cpu", "--nodes", "2"): "they need --cpu --shrink N",
           ("--cpu", "--shrink", "8", "--sizes", "100B,7B"): "--sizes 7B is not a row of these configs; valid: 1.5B, 8B,"
                                                           " 20B, 40B, 60B, 80B, 100B, 120B, 140B, 170B",
           ("--cpu", "--shrink", "8", "--gpus-per-node", "8"): "--gpus-per-node does not apply with --shrink"}
    for args, message in bad.items():
        assert sweep.main(["--figure", "2", *args, "--dry-run"]) == 2, args
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, (args, err)


def own_figures(run_dir: Path, warmup: int) -> dict:
    """A job's figures read straight from its own files: medians past `warmup`, peaks over all steps."""
    by_step = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record
    past = [by_step[s] for s in sorted(by_step) if s > warmup]
    cfg = json.loads((run_dir / "config.json").read_text())
    m, tp = cfg["model"], cfg["parallel"]["tensor"]
    h, layers, seq = m["hidden_size"], m["num_layers"], m["seq_length"]
    padded = -(-m["vocab_size"] // (128 * tp)) * 128 * tp
    world = json.loads((run_dir / "status.json").read_text())["world_size"]
    tflops = statistics.median(r["perf/tflops_per_gpu"] for r in past)
    return {"steps": max(by_step), "gpus": world,
            "tokens_per_s": statistics.median(r["perf/tokens_per_s"] for r in past), "tflops_per_gpu": tflops,
            "pflops": tflops * world / 1000,
            "peak_mem_GB": max(r.get("mem/max_allocated_bytes", r.get("mem/rss_bytes")) for r in by_step.values()) / 1e9,
            # every weight and bias (4h FFN), untied output layer, learned positions
            "params": layers * (12 * h * h + 13 * h) + 2 * h + 2 * padded * h + seq * h}


def bars_in_png(path: Path) -> list:
    """Per plot panel, the count of separate blue/orange bars crossing it, found in the pixels alone."""
    import matplotlib.image
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    img = (matplotlib.image.imread(path)[..., :3] * 255).astype(int)
    height = img.shape[0]
    colors = [(31, 119, 180), (255, 127, 14)]  # tab:blue (ZeRO), tab:orange (baseline)
    hit = sum(((abs(img - c).max(axis=2)) < 8) for c in colors) > 0
    counts = []
    for top, bottom in ((0.1, 0.5), (0.55, 0.92)):  # below the legend: the two panels
        columns = hit[int(top * height):int(bottom * height)].any(axis=0)
        counts.append(int((columns[1:] & ~columns[:-1]).sum() + columns[0]))
    return counts


@pytest.mark.timeout(900)  # 3x its quiet time (~120 s with 6 jobs, now 4, queued on 2 nodes two at a time): a hang
def test_shrunk_figure2_through_slurm_into_table_and_plot(cluster2, tmp_path):
    cluster = cluster2
    from pretrain.data.datasets import build_corpus_files
    build_corpus_files(str(REPO / "data/corpus.jsonl"), None, REPO / "runs/data", 2095)  # shared, not 20× at once
    env = cluster.env(dict(os.environ, ZERO3D_PYTHON=sys.executable, WANDB_MODE="disabled"))
    runs = tmp_path / "runs"
    proc = run_sweep("--cpu", "--shrink", str(SHRINK), "--nodes", str(NODES), "--ranks-per-node",
                     str(RANKS_PER_NODE), "--runs-dir", str(runs), "--sizes", ",".join(SIZES), f"train.steps={STEPS}", "logging.wandb=false",
                     "logging.log_interval=1", env=env)
    assert proc.returncode == 0, proc.stderr
    jobs = dict(line.split("\t") for line in proc.stdout.splitlines())
    names = sorted(f"fig2_{s.replace('.', 'p')}_{k}" for s in SIZES for k in ("zero", "baseline"))
    assert sorted(jobs) == names
    nodes_used = set()
    try:
        for name, job_id in jobs.items():
            state = wait_for(cluster, job_id, runs / name / "slurm-*.out", timeout=900)  # queued behind the others
            assert state["JobState"] == "COMPLETED", (runs / name / f"slurm-{job_id}.out").read_text()[-3000:]
            nodes_used.add(state["NodeList"])
    finally:  # on a failure, end the other jobs now: a slurmstepd outlives the fixture's slurmd
        subprocess.run(["scancel", *jobs.values()], env=env, capture_output=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and subprocess.run(["squeue", "-h"], env=env, capture_output=True,
                                                               text=True).stdout.strip():
            time.sleep(1)
    assert nodes_used == {"z3node1", "z3node2"}, nodes_used  # the sweep ran on both nodes of the cluster
    out = tmp_path / "results"
    proc = subprocess.run([sys.executable, "slurm/collect.py", "--figure", "2", "--sizes", ",".join(SIZES), "--runs-dir",
                           str(runs), "--out", str(out), "--warmup", str(WARMUP)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert_table_matches_runs(runs, out, names, NODES * RANKS_PER_NODE, STEPS, WARMUP)


def assert_table_matches_runs(runs: Path, out: Path, names: list, world: int, steps: int, warmup: int):
    """collect.py's table.csv/table.md/scaling.png in `out` against the run directories' own files."""
    with open(out / "table.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["run"] for r in rows) == names
    for r in rows:
        own = own_figures(runs / r["run"], warmup)
        assert (r["status"], int(r["steps"]), int(r["gpus"]), int(r["shrink"])) == ("ok", steps, world, SHRINK), r
        assert int(r["params"]) == own["params"] and r["model"] == r["run"].split("_")[1].replace("p", "."), r
        for key in ("tokens_per_s", "tflops_per_gpu", "pflops", "peak_mem_GB"):
            assert float(r[key]) == pytest.approx(own[key], rel=1e-9), (r["run"], key)
    sizes = [float(r["model"][:-1]) for r in rows]  # rows in the paper's order of model size
    assert sizes == sorted(sizes) and [int(r["params"]) for r in rows] == sorted(int(r["params"]) for r in rows)
    table = (out / "table.md").read_text()
    assert sum(line.startswith("| fig2_") for line in table.splitlines()) == len(names)
    assert "Reported in the paper" not in table and f"Scaled down (slurm/sweep.py --cpu --shrink {SHRINK})" in table
    assert bars_in_png(out / "scaling.png") == [len(rows), len(rows)]
