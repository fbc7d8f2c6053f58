"""slurm/submit.py refuses a job that cannot start (#39), on the submitting host, before anything is queued: --dry-run,
a submission and the job's --preflight alike, one line per reason, exit 3."""
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
    argv = TINY + mode + [f"logging.run_dir={tmp_path / 'run'}", "data.corpus=data/missing.jsonl",
                          "data.tokenizer_model=data/missing.model"]
    assert submit.main(argv) == 3
    assert lines(capsys) == [f"cannot start tiny: data.tokenizer_model: tokenizer model '{REPO}/data/missing.model' "
                             "does not exist",
                             f"cannot start tiny: data.corpus: corpus '{REPO}/data/missing.jsonl' does not exist"]
    assert not (tmp_path / "run").exists()  # the preflight wrote nothing


def test_blend_prefix_without_its_files(capsys, tmp_path):
    (tmp_path / "half.idx").write_bytes(b"")  # the .bin is missing too; the .idx is checked first
    argv = TINY + ["--dry-run", f"data.blend={tmp_path / 'gone'} {tmp_path / 'half'}",
                   f"data.tokenizer_model={tmp_path / 'tok.model'}"]
    assert submit.main(argv) == 3
    found = lines(capsys)
    assert found[1:] == [f"cannot start tiny: data.blend: indexed dataset '{tmp_path}/gone' is incomplete: "
                         f"{tmp_path}/gone.idx does not exist",
                         f"cannot start tiny: data.blend: indexed dataset '{tmp_path}/half' is incomplete: "
                         f"{tmp_path}/half.bin does not exist"]


def test_tokenizer_larger_than_the_model(capsys, tmp_path):
    """A 400-piece sentencepiece model against model.vocab_size 384: its ids would index past the embedding."""
    from pretrain.data.tokenizer import train_tokenizer
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


def test_sweep_checks_every_job_before_queueing_any(capsys):
    from slurm import sweep
    assert sweep.main(["--figure", "2", "--dry-run", "data.corpus=data/missing.jsonl"]) == 3
    captured = capsys.readouterr()
    refused = [line for line in captured.err.splitlines() if line.startswith("cannot start fig2_")]
    assert len(refused) == 20 and all(line.endswith(f"data.corpus: corpus '{REPO}/data/missing.jsonl' does not exist")
                                      for line in refused)
    assert "sbatch" not in captured.out  # nothing previewed, nothing queued
