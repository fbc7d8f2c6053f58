"""The planner's compute time from measured rows (analysis/throughput.py): each row is docs/gpu-check.md's, each bench
row is predicted within 15% by the others (leave one out), a config shaped as a row steps at its measured time (and
sizes Slurm's stop warning so), and a user's own run directory replaces the rows (`pretrain --plan --measured`)."""
import dataclasses
import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import pytest

from analysis.cluster import ClusterSpec
from analysis.estimate import Parallelism, Step, ZeroChoice
from analysis.planner import step_time
from analysis.throughput import MEASURED_ROWS, KernelPath, MeasuredRow, PublishedShare, efficiency
from model_shape.gpt import GPTShape
from pretrain.config import load_config

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from slurm import submit  # noqa: E402

DOC = (REPO / "docs/gpu-check.md").read_text()
TIMED = [r for r in MEASURED_ROWS if isinstance(r, MeasuredRow)]
PRESET = {"H100": "dgx-h100", "H200": "dgx-h200"}


def doc_section(heading: str) -> str:
    """The docs/gpu-check.md section whose `## ` heading starts with `heading`, up to the next one."""
    parts = re.split(r"^## ", DOC, flags=re.M)
    found = [p for p in parts if p.startswith(heading)]
    assert len(found) == 1, f"{heading!r}: {len(found)} sections"
    return found[0]


@pytest.mark.parametrize("row", TIMED, ids=lambda r: r.name[:40])
def test_each_row_is_a_row_of_docs_gpu_check(row):
    """Its section names its GPU, and a table line of it starts with its name and holds its step time."""
    section = doc_section(row.section)
    assert f"**NVIDIA {row.gpu}" in section
    lines = [line for line in section.splitlines() if line.startswith(f"| {row.name} |")]
    assert len(lines) == 1 and re.search(rf"\| {re.escape(f'{row.step_s:g}')}0* s? ?\|", lines[0]), lines


def test_the_rows_shapes_are_the_benchs_and_the_recipes():
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench/bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gpt = GPTShape(bench.SHAPE["layers"], bench.SHAPE["hidden"], bench.SHAPE["heads"], bench.SHAPE["seq"],
                   bench.SHAPE["vocab"])
    ll = bench.LLAMA_SHAPE
    llama = GPTShape(ll["layers"], ll["hidden"], ll["heads"], ll["seq"], ll["vocab"], ffn=ll["ffn"],
                     query_groups=ll["query_groups"], mlp="swiglu", norm="rmsnorm", position_embedding="rope",
                     bias=False)
    recipe = load_config(REPO / "configs/llama3_8b.toml")
    slice_samples = recipe.train.global_batch_size // (recipe.cluster.nodes * recipe.cluster.gpus_per_node)
    expected = {("gpt",): (gpt, bench.SHAPE["micro"]), ("llama",): (llama, ll["micro"]),
                ("8b",): (recipe.model.shape, slice_samples)}
    for row in TIMED:
        key = ("8b",) if row.shape.layers == 32 else ("llama",) if row.shape.gated else ("gpt",)
        assert (row.shape, row.samples) == expected[key], row.name


def alone_on_its_path(row) -> bool:
    return not any(r.path == row.path for r in MEASURED_ROWS if r is not row)


def test_no_row_is_alone_on_its_path():
    """Leave one out needs a second row on a row's path: every timed row has one (the float8 tensorwise 8B slice's
    since the second H200 session), so every row is predicted below."""
    assert [r.name for r in TIMED if alone_on_its_path(r)] == []


@pytest.mark.parametrize("row", [r for r in TIMED if not alone_on_its_path(r)], ids=lambda r: r.name[:40])
def test_the_planner_predicts_each_bench_row_within_15_percent_from_the_others(row):
    """The planner's step on one GPU of the row's kind (no communication), its efficiency from every row but this
    one, against the measured step time."""
    others = tuple(r for r in MEASURED_ROWS if r is not row)
    cluster = dataclasses.replace(ClusterSpec(PRESET[row.gpu], nodes=1, gpus_per_node=1).cluster("bf16"),
                                  rows=others)
    step = Step(row.samples, row.recompute, "bf16", row.path.attention, loss_recompute=row.loss_recompute,
                float8=row.path.float8, compiled=row.path.compiled)
    predicted = step_time(cluster, row.shape, Parallelism(1), ZeroChoice(2), step, row.samples,
                          row.shape.params())
    assert predicted["dp_s"] == predicted["mp_s"] == 0
    assert predicted["compute_s"] == pytest.approx(row.step_s, rel=0.15)


def test_a_config_shaped_as_a_row_steps_at_its_measured_time_and_sizes_the_stop_warning():
    """bench's GPT 1.3B row on one H100 (2026-11-26, the loss chunks recomputed): the config of that shape on one H100
    is modelled at the row's 0.1970 s, and Slurm's USR1 lead is 2 × (that + the checkpoint's write) + 60 s."""
    cfg = load_config(REPO / "configs/tiny.toml", [
        "model.num_layers=24", "model.hidden_size=2048", "model.num_attention_heads=16", "model.seq_length=2048",
        "model.vocab_size=50257", "model.loss_recompute=true", "model.attention=\"sdpa\"", "model.compile=false",
        "precision.dtype=\"bf16\"",
        "parallel.tensor=1", "zero.stage=2", "train.micro_batch_size=4", "train.global_batch_size=4",
        "cluster.nodes=1", "cluster.gpus_per_node=1", "cluster.gpu=\"H100\"", "cluster.gpu_memory_gb=80"])
    assert submit.step_seconds(cfg, 1) == pytest.approx(0.1970, rel=1e-9)
    write = submit.checkpoint_bytes(cfg) / (cfg.cluster.checkpoint_write_gbps * 1e9)
    assert submit.warning_seconds(cfg, 1) == max(submit.WARNING_FLOOR_S, math.ceil(2 * (write + 0.1970) + 60))
    big = load_config(REPO / "configs/llama3_8b.toml", ["data.corpus=\"data/corpus.jsonl\"", "cluster.nodes=8"])
    lead = submit.warning_seconds(big, 8)
    step = submit.step_seconds(big, 8)
    assert lead == max(submit.WARNING_FLOOR_S, math.ceil(2 * (submit.checkpoint_bytes(big) / 5e9 + step) + 60))
    assert step > 0


def test_efficiency_falls_back_from_the_gpu_and_path_stated():
    paper = efficiency("V100", KernelPath())
    assert paper.value == 39 / 125 and paper.match == "V100, local attention, eager"
    compiled = efficiency("A100", KernelPath("fused", compiled=True))
    assert compiled.match == ("none on A100 along fused attention, compiled; rows of the same attention, compiled, "
                              "float8")
    assert {r.gpu for r in compiled.rows} == {"H200"} and all(r.path.compiled for r in compiled.rows)
    # float8 first: the paper's kernels in float8 on an H100 take the float8 row's share, not bf16's
    fp8 = efficiency("H100", KernelPath(float8="tensorwise"))
    assert [r.path.float8 for r in fp8.rows] == ["tensorwise"] * 2 and fp8.value < 0.25
    h200 = efficiency("H200", KernelPath("fused"))
    assert h200.value == pytest.approx(sum(r.efficiency for r in h200.rows) / len(h200.rows))
    assert len(h200.rows) == 6 and all(r.gpu == "H200" and r.path == KernelPath("fused") for r in h200.rows)
    only = (PublishedShare("x", "H100", KernelPath("fused", float8="rowwise"), 0.5),)
    assert efficiency("H200", KernelPath(), only).match == "none on H200 along local attention, eager or alike; every row"


def write_run(run: Path, cfg, world: int, steps: list) -> None:
    """A run directory as pretrain writes it: config.json, status.json and metrics.jsonl with `steps`' times."""
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    (run / "status.json").write_text(json.dumps({"status": "ok", "world_size": world}))
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i + 1, "perf/step_time_s": t, "perf/phase/comm_exposed_s": c}) + "\n"
        for i, (t, c) in enumerate(steps)))


def test_a_users_run_directory_replaces_the_rows(tmp_path, capsys):
    """--measured RUN_DIR: the run's median step less its exposed communication after the warm-up steps, its model's
    hardware FLOPs per GPU (Megatron's formula, written here) at the H200's 989 TFLOP/s."""
    from pretrain.__main__ import main
    ran = load_config(REPO / "configs/llama3_8b.toml", ["data.corpus=\"data/corpus.jsonl\"", "cluster.gpu=\"H200\"",
                                                       "logging.summary_warmup_steps=1"])
    steps = [(99.0, 0.0), (13.0, 1.0), (12.5, 0.5), (14.0, 1.0)]  # the first is warm-up; compute 12, 12, 13 s
    write_run(tmp_path / "run", ran, 16, steps)
    b, s, h, layers, v, f, kv = 128, 8192, 4096, 32, 128256, 14336, 1024
    per_token = 2 * (h * h + 2 * h * kv + h * h + 3 * h * f) + 4 * s * h  # linears + QKᵀ and AV, one forward
    hardware = 4 * layers * per_token * b * s + 3 * 2 * h * v * b * s  # full recompute: the layers' forward twice
    share = hardware / 16 / 12.0 / 989e12
    assert main(["--config", str(REPO / "configs/llama3_8b.toml"), "--plan", "--top", "1", "--measured",
                 str(tmp_path / "run"), "data.corpus=\"data/corpus.jsonl\"", "cluster.gpu=\"H200\""]) == 0
    out = capsys.readouterr().out
    # the run's model.compile is the default, "auto": compiled on the GPU it ran on
    assert f"compute at {share:.1%} of peak, the mean of 1 measured row(s) (H200, fused attention, compiled)" in out


def test_measured_refuses_a_directory_that_is_no_run(tmp_path, capsys):
    from pretrain.__main__ import main
    (tmp_path / "empty").mkdir()
    code = main(["--config", str(REPO / "configs/llama3_8b.toml"), "--plan", "--measured", str(tmp_path / "empty"),
                 "data.corpus=\"data/corpus.jsonl\""])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "is not a run directory" in err and "config.json" in err and "\n" not in err, err


@pytest.mark.parametrize("metrics", [b"\xff\xfe not json\n", b'{"step": "x", "perf/step_time_s": 1}\n{"step": 2}\n',
                                     b'[1, 2]\n', b'{"step": 2, "perf/step_time_s": "fast"}\n',
                                     b'{"step": 2, "perf/step_time_s": 1e-9}\n',
                                     b'{"step": 2, "perf/step_time_s": 1.0, "perf/phase/comm_exposed_s": 2.0}\n'],
                         ids=["bytes", "mixed-steps", "a-list", "a-string", "faster-than-peak", "negative-compute"])
def test_a_run_directorys_bad_bytes_are_one_line(tmp_path, capsys, metrics):
    """Whatever metrics.jsonl holds: exit 2 and one line naming the directory, never a traceback."""
    from pretrain.__main__ import main
    ran = load_config(REPO / "configs/llama3_8b.toml", ["data.corpus=\"data/corpus.jsonl\""])
    write_run(tmp_path / "run", ran, 16, [(1.0, 0.0)])
    (tmp_path / "run" / "metrics.jsonl").write_bytes(metrics)
    code = main(["--config", str(REPO / "configs/llama3_8b.toml"), "--plan", "--measured", str(tmp_path / "run"),
                 "data.corpus=\"data/corpus.jsonl\""])
    err = capsys.readouterr().err.strip()
    assert code == 2 and f"--measured {str(tmp_path / 'run')!r}" in err and "\n" not in err, err
