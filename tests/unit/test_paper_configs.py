"""The generated paper configs: committed = generated, every CSV row covered, every job submittable, pins agree."""
import json
import re
import tomllib
from pathlib import Path

import pytest

from configs import generate_paper
from pretrain.config import load_config, validate_layout
from slurm import submit, sweep

REPO = Path(__file__).resolve().parents[2]
PAPER = REPO / "configs/paper"
JOBS = sorted(PAPER.glob("fig*_*.toml"))
TABLE_III = generate_paper.ZERO_CONFIGS


@pytest.fixture(autouse=True)
def plain_launch_env(monkeypatch):
    """The dry-run lines below assume no interpreter or container chosen through the environment."""
    for name in ("ZERO3D_PYTHON", "ZERO3D_CONTAINER", "ZERO3D_CONTAINER_MOUNTS", "ZERO3D_REQUEUE"):
        monkeypatch.delenv(name, raising=False)


def zero_of(path: Path) -> tuple:
    z = load_config(path).zero
    return z.stage, z.partition_activations, z.cpu_checkpointing


def test_committed_files_are_what_the_generator_writes(capsys):
    assert generate_paper.main(["--check"]) == 0, capsys.readouterr()


def test_generating_twice_gives_identical_files(tmp_path):
    for out in (tmp_path / "a", tmp_path / "b"):
        assert generate_paper.main(["--out", str(out)]) == 0
    a = {p.name: p.read_bytes() for p in (tmp_path / "a").iterdir()}
    b = {p.name: p.read_bytes() for p in (tmp_path / "b").iterdir()}
    assert a == b and len(a) == len(JOBS)


def test_check_catches_an_edited_or_stale_file(tmp_path, capsys):
    assert generate_paper.main(["--out", str(tmp_path)]) == 0
    edited = tmp_path / JOBS[0].name
    edited.write_text(edited.read_text().replace("steps = 100", "steps = 99"))
    (tmp_path / "fig9_1B_zero.toml").write_text("")
    assert generate_paper.main(["--check", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "differs" in out and "fig9_1B_zero.toml: not produced" in out


def test_every_csv_row_has_a_job_and_every_job_names_its_row():
    rows = generate_paper.read_rows(generate_paper.DEFAULT_CSV)
    assert len(rows) == 41
    headers = {p.name: p.read_text().splitlines()[1] for p in JOBS}
    for row in rows:
        assert any(h == f"# CSV line {row.line}: {row.text}" for h in headers.values()), row.where()
    assert all(h.startswith("# CSV line ") for h in headers.values())


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.stem)
def test_every_job_validates_and_dry_runs(path, capsys, gpt2_overrides):
    cfg = load_config(path)
    world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    assert validate_layout(cfg, world) == 1  # the paper's batches need no accumulation
    assert cfg.logging.name == path.stem and cfg.logging.wandb_group == path.stem.split("_")[0]
    assert cfg.model.recompute == "full" and cfg.model.seq_length == 1024 and cfg.model.vocab_size == 50257
    # GPT-2's BPE files at the documented paths, which the user supplies (tests/gpt2_files.py stands in for them)
    d = cfg.data
    assert (d.tokenizer_kind, d.tokenizer_model, d.tokenizer_merges) == (
        "gpt2_bpe", generate_paper.GPT2_VOCAB_JSON, generate_paper.GPT2_MERGES_TXT)
    # a job the paper reports out of memory is refused before it queues (exit 3, one line) unless told to run
    # anyway, as slurm/sweep.py tells it (train.ignore_memory_estimate = true)
    oom, ignore = cfg.paper.expected == "oom", list(gpt2_overrides)
    assert submit.main(["--config", str(path), "--dry-run", *ignore]) == (3 if oom else 0)
    if oom:
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"cannot start {path.stem}: the memory estimate ") and "\n" not in err, err
        ignore += ["train.ignore_memory_estimate=true"]
        assert submit.main(["--config", str(path), "--dry-run", *ignore]) == 0
    cfg = load_config(path, ignore)
    out = capsys.readouterr().out
    rel = path.relative_to(REPO)
    sbatch = next(line for line in out.splitlines() if line.startswith("sbatch:"))
    assert f"--nodes={cfg.cluster.nodes}" in sbatch and f"--gpus-per-node={cfg.cluster.gpus_per_node}" in sbatch
    assert f"--time={cfg.cluster.time_limit}" in sbatch and sbatch.endswith(" ".join([f"slurm/launch.sbatch {rel}", *ignore]))
    warning = int(re.search(r"--signal=USR1@(\d+)", sbatch).group(1))
    assert warning == submit.warning_seconds(cfg, cfg.cluster.nodes) and warning < submit.time_limit_seconds(cfg.cluster.time_limit)
    train = next(line for line in out.splitlines() if line.startswith("train:"))
    assert train.split() == ["train:", "srun", "--kill-on-bad-exit=1", "--cpu-bind=none", "python", "-m",
                             "pretrain", "--config", str(rel), *ignore]
    resolved = json.loads(out[out.index("\n{") + 1:])
    assert resolved == cfg.to_dict()


def test_figure4_maps_sizes_to_c1_to_c5():
    expected = {"40B": "C1", "60B": "C2", "50B": "C3", "140B": "C4", "150B": "C5"}
    found = {p.stem.split("_")[1]: p for p in PAPER.glob("fig4_*.toml")}
    assert set(found) == set(expected)
    for model, label in expected.items():
        assert found[model].stem.endswith(label.lower())
        assert zero_of(found[model]) == TABLE_III[label], model


def test_zero_settings_per_figure():
    for p in JOBS:
        figure, model, system = p.stem.split("_")[:3]
        cfg = load_config(p)
        if system == "baseline":
            assert zero_of(p) == (0, False, False) and not cfg.zero.contiguous_checkpointing, p.name
            continue
        assert cfg.zero.contiguous_checkpointing and cfg.zero.bucket_elements == generate_paper.BUCKET_ELEMENTS
        if cfg.parallel.tensor == 1:  # Figure 7 and the 1.5B bar: Pos+g, nothing for Pa to split
            assert zero_of(p) == TABLE_III["C3"], p.name
        elif figure in ("fig2", "fig3"):
            assert zero_of(p) == TABLE_III["C5" if model == "170B" else "C4"], p.name
    assert sorted(p.stem for p in PAPER.glob("fig5_*.toml")) == [
        f"fig5_{m}_zero_c{i}" for m in ("100B", "40B") for i in range(1, 6)]
    # Figure 6's batches 2, 4, 32, 32, 8 in the order the appendix prints Figure 4's configurations
    for label, batch in zip(("C1", "C2", "C4", "C5", "C3"), (2, 4, 32, 32, 8)):
        path = PAPER / f"fig6_60B_zero_{label.lower()}.toml"
        assert zero_of(path) == TABLE_III[label] and load_config(path).train.micro_batch_size == batch
        assert "ASSUMPTION" in path.read_text()
    assert zero_of(PAPER / "fig6_170B_zero_c5.toml") == TABLE_III["C5"]


def test_v100_jobs_train_in_fp16_with_dynamic_loss_scaling():
    for p in JOBS:
        cfg = load_config(p)
        assert (cfg.cluster.gpu, cfg.precision.dtype) == ("V100", "fp16"), p.name
        assert cfg.precision.initial_loss_scale > cfg.precision.min_loss_scale and cfg.precision.growth_interval > 0


def test_bf16_for_a_v100_is_refused(tmp_path, capsys):
    assert generate_paper.main(["--out", str(tmp_path), "--dtype", "bf16"]) == 2
    assert "--dtype bf16 with --gpu V100: the V100 has no bf16" in capsys.readouterr().err


def test_only_what_the_paper_reports_out_of_memory_is_marked_and_every_other_job_fits():
    from pretrain.memory_check import config_report
    oom = {p.stem for p in JOBS if load_config(p).paper.expected == "oom"}
    assert oom == {"fig5_100B_zero_c1", "fig5_100B_zero_c2", "fig5_100B_zero_c3"}
    for p in JOBS:
        cfg = load_config(p)
        estimate, table = config_report(cfg, cfg.cluster.nodes * cfg.cluster.gpus_per_node)
        assert estimate.fits == (p.stem not in oom), f"{p.name}\n{table}"
    # the rows the paper ran that a 15% margin refused
    for name in ("fig2_170B_zero", "fig6_170B_zero_c5", "fig7_12B_zero", "fig7_13B_zero", "fig6_60B_zero_c3"):
        assert name not in oom and (PAPER / f"{name}.toml").is_file()


def test_plan_csv_judges_each_job_as_its_config_and_agrees_with_estimate():
    from pretrain.memory_check import config_report
    from analysis import paper_configs
    verdicts = paper_configs.judge_all(REPO / "configs/paper/reproduction-configs.csv")
    by_job = {}
    for v in verdicts:
        r = v.run
        by_job.setdefault((r.figure, r.model, r.system, r.label), []).append(v)
    for p in JOBS:
        cfg = load_config(p)
        figure, model, system = p.stem.split("_")[:3]
        label = None if system == "baseline" else {v: k for k, v in TABLE_III.items()}[zero_of(p)]
        candidates = by_job[(int(figure[3:]), model.replace("p", "."), system, label)]
        world = cfg.cluster.nodes * cfg.cluster.gpus_per_node
        v = next(v for v in candidates if v.run.gpus == world and v.run.batch_per_gpu == cfg.train.micro_batch_size)
        assert v.memory.total_bytes == config_report(cfg, world)[0].total_bytes, p.name


def test_sweep_skips_jobs_the_paper_reports_out_of_memory_unless_asked(capsys, gpt2_overrides):
    assert sweep.main(["--figure", "5", "--dry-run", *gpt2_overrides]) == 0
    captured = capsys.readouterr()
    submitted = [line.split(":")[0] for line in captured.out.splitlines() if line.startswith("fig5_")]
    assert sorted(submitted) == ["fig5_100B_zero_c4", "fig5_100B_zero_c5"] + [f"fig5_40B_zero_c{i}" for i in range(1, 6)]
    assert "skipped fig5_100B_zero_c1: the paper reports 100B out of memory in C1" in captured.err
    assert sweep.main(["--figure", "5", "--dry-run", "--include-oom", *gpt2_overrides]) == 0
    assert "10 jobs (dry run, nothing submitted); 0 the paper" in capsys.readouterr().out


def test_shrunk_jobs_train_their_own_tokenizer():
    """--cpu --shrink: GPT-2's 50,257 ids would index past the shrunk embedding (vocab 2095 at ÷24), so the scaled-down
    jobs go back to a sentencepiece of their vocabulary trained from the demo corpus and need no GPT-2 files."""
    from slurm.startable import refusals
    path = PAPER / "fig2_100B_zero.toml"
    cfg = load_config(path, sweep.shrink_overrides([path], 24, 2, 2, "runs/shrink24")[path])
    assert (cfg.data.tokenizer_kind, cfg.data.tokenizer_model, cfg.data.tokenizer_merges) == ("sentencepiece", None, None)
    assert cfg.model.vocab_size == 2095 and refusals(cfg, 4, REPO, memory=False) == []


def test_bucket_matches_the_estimator_default():
    from analysis.estimate import DEFAULT_BUCKET_ELEMENTS
    assert generate_paper.BUCKET_ELEMENTS == DEFAULT_BUCKET_ELEMENTS


CSV_HEAD = "# a comment\nfigure,model,system,gpus,mp,layers,hidden,heads,batch_per_gpu,total_batch\n"


@pytest.mark.parametrize("row, rule", [
    ("2,1B,zero,400,16,10,1536,24,4,100", "heads % mp == 0"),
    ("2,1B,zero,400,16,10,1000,16,4,100", "hidden % heads == 0"),
    ("2,1B,zero,400,16,10,1024,16,4,99", "total_batch == batch_per_gpu × gpus / mp"),
    ("2,1B,zero,100,16,10,1024,16,4,25", "gpus % mp == 0"),
    ("3,1B,zero,64;128,16,10,1024,16,4;8;16,16;64", "same number of ';'-separated values"),
])
def test_an_invalid_row_is_refused_naming_row_and_rule(tmp_path, capsys, row, rule):
    csv_path = tmp_path / "bad.csv"
    csv_path.write_text(CSV_HEAD + "2,1.5B,zero,400,1,48,1600,16,24,9600\n" + row + "\n")
    assert generate_paper.main(["--csv", str(csv_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "CSV line 4" in err and rule in err and row in err
    assert not (tmp_path / "out").exists()


def test_gpus_per_node_8_and_fp16_regenerate(tmp_path):
    out = tmp_path / "gpn8"
    assert generate_paper.main(["--out", str(out), "--gpus-per-node", "8", "--dtype", "fp16"]) == 0
    cfg = load_config(out / "fig2_100B_zero.toml")
    assert (cfg.cluster.nodes, cfg.cluster.gpus_per_node, cfg.precision.dtype) == (50, 8, "fp16")
    assert load_config(out / "fig2_40B_baseline.toml").cluster.nodes == 48  # 384 GPUs


def test_sweep_dry_run_covers_a_figure_with_group_and_node_size(capsys, gpt2_overrides):
    assert sweep.main(["--figure", "4", "--dry-run", "--group", "trial", "--gpus-per-node", "8", *gpt2_overrides]) == 0
    out = capsys.readouterr().out
    sbatch_lines = [line for line in out.splitlines() if line.startswith("fig4_")]
    assert len(sbatch_lines) == 5
    assert all("--nodes=50" in line and "logging.wandb_group=trial" in line for line in sbatch_lines)
    assert sweep.main(["--all", "--dry-run", *gpt2_overrides]) == 0
    assert f"{len(JOBS) - 3} jobs (dry run, nothing submitted); 3 the paper" in capsys.readouterr().out


def test_submit_refuses_an_invalid_config_before_sbatch(capsys, monkeypatch):
    monkeypatch.setattr(submit, "submit", lambda job: pytest.fail("sbatch must not run"))
    assert submit.main(["--config", str(PAPER / "fig2_100B_zero.toml"), "train.global_batch_size=801"]) == 2
    assert "train.global_batch_size = 801 is not divisible" in capsys.readouterr().err


def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower()


def test_dockerfile_pins_agree_with_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["hf"]  # the image exports HF models too
    expected = {_requirement_name(d): d.replace(" ", "") for d in deps if _requirement_name(d) != "torch"}
    text = (REPO / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", base), base
    install = text[text.index("pip install"):text.index("--no-deps -e .")]
    pinned = {_requirement_name(r): r for r in re.findall(r'"([^"]+)"', install)}
    assert pinned == expected
    assert "torch" not in pinned  # the image's NVIDIA build is the one used
