"""slurm/submit.py refuses a job that cannot start (#39), on the submitting host, before anything is queued: --dry-run,
a submission and the job's --preflight alike, one line, exit 3."""
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from slurm import submit  # noqa: E402

TINY = ["--config", "configs/tiny.toml"]


def lines(capsys) -> list:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("cannot start")]


@pytest.mark.parametrize("mode", [["--dry-run"], ["--preflight", "--world-size", "4"]])
def test_missing_inputs_each_one_line(mode, capsys, tmp_path):
    """The paths every rank checks at start-up (pretrain/runtime/preflight.py), checked from the repository root
    the job runs in; the preflight writes nothing for a job that cannot start."""
    run = [f"logging.run_dir={tmp_path / 'run'}"]
    assert submit.main(TINY + mode + run + ["data.corpus=data/missing.jsonl"]) == 3
    assert lines(capsys) == [f"cannot start tiny: data.corpus = 'data/missing.jsonl' does not exist (relative to the "
                             f"working directory {REPO}); point data.corpus at JSONL files ({{\"text\": ...}} a line; "
                             ".gz/.zst too), Parquet or Arrow files, or a glob"]
    assert submit.main(TINY + mode + run + ["data.tokenizer_model=data/missing.model"]) == 3
    assert lines(capsys) == [f"cannot start tiny: data.tokenizer_model = 'data/missing.model' does not exist (relative "
                             f"to the working directory {REPO}); point it at a sentencepiece .model file, or unset it "
                             "to train one from data.corpus"]
    assert not (tmp_path / "run").exists()  # the preflight wrote nothing


def test_blend_prefix_without_its_index(capsys, tmp_path):
    (tmp_path / "half.bin").write_bytes(b"")
    argv = TINY + ["--dry-run", "~data.corpus", f"data.blend={tmp_path / 'half'}", "data.tokenizer_model=data/corpus.jsonl"]
    assert submit.main(argv) == 3
    assert lines(capsys) == [f"cannot start tiny: data.blend = '{tmp_path}/half.idx' does not exist; {tmp_path}/half.idx"
                             " is missing; run python -m pretrain.preprocess to write it, or fix the prefix in data.blend"]


def test_tokenizer_larger_than_the_model(capsys, tmp_path):
    """A 400-piece sentencepiece model against model.vocab_size 384: its ids would index past the embedding."""
    from pretrain.data.preprocess import train_tokenizer
    model = train_tokenizer(REPO / "data/corpus.jsonl", tmp_path / "tok", 400, max_sentences=2000)
    assert submit.main(TINY + ["--dry-run", f"data.tokenizer_model={model}", "model.vocab_size=384"]) == 3
    assert lines(capsys) == [f"cannot start tiny: data.tokenizer_model: tokenizer vocabulary 400 is larger than "
                             f"model.vocab_size 384; raise model.vocab_size or use a smaller tokenizer ({model})"]
    assert submit.main(TINY + ["--dry-run", f"data.tokenizer_model={model}", "model.vocab_size=400"]) == 0


def test_layout_that_does_not_fit_the_gpus(capsys):
    """tiny on 4 GPUs of 0.01 GiB (1.07e7 bytes): its own estimate (pretrain --estimate's) does not fit."""
    from pretrain.config import load_config
    from pretrain.memory_check import device_estimate
    cfg = load_config("configs/tiny.toml", ["cluster.gpu_memory_gb=0.01"])
    total = device_estimate(cfg, 4, 0.01 * 2**30)[0].total_bytes
    assert total > 0.01 * 2**30
    assert submit.main(TINY + ["--dry-run", "cluster.gpu_memory_gb=0.01"]) == 3
    assert lines(capsys) == [f"cannot start tiny: the memory estimate {total / 1e9:.2f} GB exceeds cluster.gpu_memory_gb"
                             f" = 0.01 GiB (0.01 GB) on 4 GPUs (H100); python -m pretrain --estimate shows where it "
                             "goes, train.ignore_memory_estimate = true runs anyway"]
    assert submit.main(TINY + ["--dry-run", "cluster.gpu_memory_gb=0.01", "train.ignore_memory_estimate=true"]) == 0
    assert submit.main(TINY + ["--dry-run", "--cpu", "cluster.gpu_memory_gb=0.01"]) == 0  # CPU ranks: no device budget


def test_sweep_checks_every_job_before_queueing_any(capsys, gpt2_overrides):
    from slurm import sweep
    assert sweep.main(["--figure", "2", "--dry-run", "data.corpus=data/missing.jsonl", *gpt2_overrides]) == 3
    captured = capsys.readouterr()
    refused = [line for line in captured.err.splitlines() if line.startswith("cannot start fig2_")]
    assert len(refused) == 20 and all(f": data.corpus = 'data/missing.jsonl' does not exist (relative to the working "
                                          f"directory {REPO}); " in line for line in refused)
    assert "sbatch" not in captured.out  # nothing previewed, nothing queued


PAPER_100B = ["--config", str(REPO / "configs/paper/fig2_100B_zero.toml")]


@pytest.mark.parametrize("mode", [["--dry-run"], ["--preflight", "--world-size", "400"]])
def test_paper_config_without_gpt2s_files_is_one_line(mode, capsys, monkeypatch, tmp_path):
    """The paper configs name GPT-2's vocab.json and merges.txt at data/gpt2/ (configs/generate_paper.py), which the
    user supplies: in a checkout without them (here `tmp_path` as the root the job runs in, so files a user put in
    this checkout change nothing), one line naming the missing file and where GPT-2's go, exit 3, nothing queued."""
    monkeypatch.setattr(submit, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(submit, "submit", lambda job: pytest.fail("nothing may be queued"))
    assert submit.main(PAPER_100B + mode) == 3
    assert lines(capsys) == [f"cannot start fig2_100B_zero: data.tokenizer_model = 'data/gpt2/vocab.json' does not "
                             f"exist (relative to the working directory {tmp_path}); put GPT-2's vocab.json there and "
                             "its merges.txt at 'data/gpt2/merges.txt' (slurm/README.md, Data), or point "
                             "data.tokenizer_model and data.tokenizer_merges at your copies"]
    (tmp_path / "data/gpt2").mkdir(parents=True)
    (tmp_path / "data/gpt2/vocab.json").write_text("{}")
    assert submit.main(PAPER_100B + mode) == 3
    assert lines(capsys) == [f"cannot start fig2_100B_zero: data.tokenizer_merges = 'data/gpt2/merges.txt' does not "
                             f"exist (relative to the working directory {tmp_path}); put GPT-2's merges.txt there "
                             "(slurm/README.md, Data), or point data.tokenizer_merges at your copy"]


@pytest.mark.parametrize("mode", [["--dry-run"], ["--preflight", "--world-size", "400"]])
def test_paper_config_with_gpt2_format_files_passes(mode, capsys, gpt2_overrides, tmp_path):
    """With files in GPT-2's format (tests/gpt2_files.py, 260 tokens <= model.vocab_size 50257) and the shipped corpus,
    the 100B job can start: the dry run previews it, the preflight prints its run directory."""
    assert submit.main(PAPER_100B + mode + gpt2_overrides + [f"logging.run_dir={tmp_path / 'run'}"]) == 0
    assert lines(capsys) == []


def test_container_paths_are_checked_where_the_container_sees_them(capsys, tmp_path, monkeypatch):
    """--container: each path the run uses must lie inside a mount (the repository at its own path, and
    ZERO3D_CONTAINER_MOUNTS), and is checked at the mount's source on this host: a corpus that exists here but is
    not mounted is refused, a blend whose container path does not exist here but whose mount source holds it passes."""
    host = tmp_path / "lustre" / "owt"
    host.mkdir(parents=True)
    for suffix in (".bin", ".idx"):
        (host / f"tokens{suffix}").write_bytes(b"")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "here, not in the container"}\n')
    container = ["--dry-run", "--container", "/img/zero3d.sqsh"]
    monkeypatch.delenv("ZERO3D_CONTAINER_MOUNTS", raising=False)
    assert submit.main(TINY + ["--dry-run", f"data.corpus={corpus}"]) == 0  # the host alone sees it
    capsys.readouterr()
    assert submit.main(TINY + container + [f"data.corpus={corpus}"]) == 3
    assert lines(capsys) == [f"cannot start tiny: data.corpus = '{corpus}' is outside every container mount ({REPO}): "
                             "add HOST_DIR:DIR to ZERO3D_CONTAINER_MOUNTS (comma-separated), or use a path under one "
                             "of them"]
    blend = ["~data.corpus", "data.blend=/data/owt/tokens", 'data.tokenizer_kind="none"', "data.eod_id=0"]
    assert submit.main(TINY + ["--dry-run"] + blend) == 3  # on the host /data/owt is nothing
    assert "data.blend = '/data/owt/tokens.bin' does not exist" in lines(capsys)[0]
    monkeypatch.setenv("ZERO3D_CONTAINER_MOUNTS", f"{host}:/data/owt:ro")
    assert submit.main(TINY + container + blend) == 0, capsys.readouterr().err
    assert f"--container-mounts={REPO}:{REPO},{host}:/data/owt:ro" in capsys.readouterr().out
    (host / "tokens.idx").unlink()  # the mount's source decides
    assert submit.main(TINY + container + blend) == 3
    assert lines(capsys) == [f"cannot start tiny: data.blend = '{host}/tokens.idx' does not exist; {host}/tokens.idx "
                             "is missing; run python -m pretrain.preprocess to write it, or fix the prefix in data.blend"]


def test_jobs_of_one_run_directory_share_a_name_and_wait_for_each_other(capsys, tmp_path):
    """--dependency=singleton with a job name per run directory: a resubmitted job waits for the one still writing
    its directory (pretrain/runtime/lock.py takes that job's lock over once Slurm has ended it: ZERO3D_SINGLETON)."""
    import hashlib
    run = [f"logging.run_dir={tmp_path / 'run'}"]
    job = submit.build_job("configs/tiny.toml", run)
    name = f"tiny-{hashlib.sha256(str((tmp_path / 'run').resolve()).encode()).hexdigest()[:8]}"
    assert f"--job-name={name}" in job.sbatch and "--dependency=singleton" in job.sbatch
    assert job.env["ZERO3D_SINGLETON"] == "1"
    assert f"--job-name={name}" in submit.build_job("configs/tiny.toml", run + ["train.steps=4"]).sbatch
    other = submit.build_job("configs/tiny.toml", [f"logging.run_dir={tmp_path / 'other'}"])
    assert f"--job-name={name}" not in other.sbatch
    assert submit.main(TINY + ["--dry-run"] + run) == 0
    assert f"ZERO3D_SINGLETON=1 sbatch --parsable --job-name={name} --dependency=singleton " in capsys.readouterr().out


def test_a_recipe_that_names_no_data_is_refused_before_it_queues(capsys):
    """configs/llama3_8b.toml sets no data.blend: refused, not a 2-day job on the demo corpus."""
    assert submit.main(["--config", "configs/llama3_8b.toml", "--dry-run"]) == 3
    assert lines(capsys) == ["cannot start llama3_8b: no data to train on: data.corpus, data.blend and data.train_blend "
                             "are all unset; name it: data.blend = \"<prefix>\" (.bin/.idx written by python -m "
                             "pretrain.preprocess), or data.corpus = \"<JSONL, Parquet or Arrow file or glob>\" "
                             "(data/corpus.jsonl is the shipped demo corpus)"]
