"""Each tokenizer kind end to end (#38): the shipped corpus preprocessed with `python -m pretrain.preprocess`'s code
into .bin/.idx, a tiny one-process `python -m pretrain` run on them (data.blend + the tokenizer that made them),
its checkpoint resumed, and a restart naming another tokenizer file of the same kind and vocabulary refused by
the checkpoint's tokenizer hash alone (the data prefix is the same) in one line, exit 3, the run directory as it was.

The hf / gpt2_bpe / tiktoken files are test_tokenizer_kinds.py's (a byte-level BPE trained with `tokenizers` on
the shipped corpus, written in each format); the sentencepiece model is trained by the preprocess command."""
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from cli_fork import run_pretrain_cli
from pretrain.data import preprocess as preprocess_cli
from pretrain.data.corpus import read_documents
from pretrain.data.preprocess import train_tokenizer
from pretrain.data.tokenizers import TokenizerSpec, identity_path, load_tokenizer
from pretrain.errors import EXIT_INPUT
from test_tokenizer_kinds import CORPUS, VOCAB, files  # noqa: F401  (files: the module-scoped fixture)

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_NODELIST", "SLURM_STEP_NODELIST", "ZERO3D_DEBUG",
                 "ZERO3D_EXIT_FILE", "ZERO3D_INTERRUPTED_EXIT")
TINY = ["--config", "configs/tiny.toml", "parallel.tensor=1", "model.num_layers=1", "model.hidden_size=32",
        "model.num_attention_heads=4", "model.seq_length=16", f"model.vocab_size={VOCAB}",
        "train.micro_batch_size=2", "train.global_batch_size=2", "train.eval_interval=0", "optimizer.warmup_steps=0",
        "zero.bucket_elements=1000", "logging.wandb=false", "logging.console=plain"]
KINDS = ["sentencepiece", "hf", "gpt2_bpe", "tiktoken"]


def q(path) -> str:
    return json.dumps(str(path))


def swapped_ids(source: Path, target: Path, kind: str) -> None:
    """The same vocabulary with two ordinary tokens' ids exchanged: a different tokenizer of the same size and
    end-of-document id (so the .bin/.idx still pass every data check and only the hash tells them apart)."""
    if kind == "tiktoken":  # base64 token, rank a line: exchange the last two ranks
        lines = source.read_text().splitlines()
        (a, ra), (b, rb) = (line.split() for line in lines[-2:])
        target.write_text("\n".join(lines[:-2] + [f"{a} {rb}", f"{b} {ra}"]) + "\n")
        return
    data = json.loads(source.read_text())
    vocab = data["model"]["vocab"] if kind == "hf" else data
    first, second = (token for token, i in vocab.items() if i in (VOCAB - 3, VOCAB - 2))
    vocab[first], vocab[second] = vocab[second], vocab[first]
    target.write_text(json.dumps(data, ensure_ascii=False))


@pytest.fixture(scope="module")
def tokenizers(files, tmp_path_factory):  # noqa: F811
    """Per kind: (spec of the tokenizer to preprocess and train with or None: trained by preprocess, the
    different file of the same kind that a restart names)."""
    root, _ = files
    other = tmp_path_factory.mktemp("other")
    # a second sentencepiece model of the same vocabulary, trained on a third of the corpus's lines
    train_tokenizer(CORPUS, other / "sp", VOCAB, max_sentences=4000)
    swapped_ids(root / "tokenizer.json", other / "tokenizer.json", "hf")
    swapped_ids(root / "vocab.json", other / "vocab.json", "gpt2_bpe")
    swapped_ids(root / "bpe.tiktoken", other / "bpe.tiktoken", "tiktoken")
    return {"sentencepiece": (None, other / "sp.model"),
            "hf": (TokenizerSpec("hf", str(root / "tokenizer.json")), other / "tokenizer.json"),
            "gpt2_bpe": (TokenizerSpec("gpt2_bpe", str(root / "vocab.json"), str(root / "merges.txt")),
                         other / "vocab.json"),
            "tiktoken": (TokenizerSpec("tiktoken", str(root / "bpe.tiktoken")), other / "bpe.tiktoken")}


def run_pretrain(args: list[str]) -> subprocess.CompletedProcess:
    """The real command (its __main__, forked from a process that imported torch once: tests/cli_fork.py), one
    process (one thread), from the repository root, no launcher variables."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS} | {"OMP_NUM_THREADS": "1"}
    return run_pretrain_cli([*TINY, *args], env, REPO, timeout=300)


def snapshot(run_dir: Path) -> dict:
    return {str(p.relative_to(run_dir)): p.read_bytes() if p.is_file() else None for p in sorted(run_dir.rglob("*"))}


def identity_sha256(spec: TokenizerSpec, cache_dir: Path) -> str:
    """What a checkpoint's identity holds for `spec` (run_identity hashes DataFiles.tokenizer_path's bytes)."""
    return hashlib.sha256(Path(identity_path(load_tokenizer(spec), spec, cache_dir)).read_bytes()).hexdigest()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", KINDS)
def test_preprocessed_tokens_train_resume_and_refuse_another_tokenizer(tmp_path, tokenizers, kind, capsys):
    spec, different = tokenizers[kind]
    prefix, cache, run_dir = tmp_path / "tokens", tmp_path / "cache", tmp_path / "run"
    if spec is None:  # sentencepiece: trained on the corpus by the preprocess command itself
        spec = TokenizerSpec("sentencepiece", str(tmp_path / "sp.model"))
        train = ["--train-tokenizer", "--vocab-size", str(VOCAB)]
    else:
        train = []
    merges = ["--tokenizer-merges", spec.merges] if spec.merges else []
    assert preprocess_cli.main(["--input", str(CORPUS), "--tokenizer-kind", kind, "--tokenizer-model", spec.model,
                                *merges, "--output-prefix", str(prefix), "--workers", "1", *train]) == 0
    capsys.readouterr()
    assert load_tokenizer(spec).vocab_size == VOCAB

    # optimizer.decay_steps fixed: the resume below trains on to train.steps = 4 on the first run's schedule
    data = ["~data.corpus", f"data.blend={q(prefix)}", f"data.tokenizer_kind={q(kind)}", f"data.cache_dir={q(cache)}",
            f"logging.run_dir={q(run_dir)}", "optimizer.decay_steps=4"] + (
        [f"data.tokenizer_merges={q(spec.merges)}"] if spec.merges else [])
    first = run_pretrain(data + [f"data.tokenizer_model={q(spec.model)}", "train.steps=2"])
    assert first.returncode == 0, first.stderr[-3000:]
    assert "no checkpoint in" in first.stdout
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"

    again = data + [f"data.tokenizer_model={q(spec.model)}", "train.steps=4"]
    second = run_pretrain(again)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step_00000002 " in second.stdout and "continuing at step 3" in second.stdout, second.stdout
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000004"

    # the same command naming another tokenizer file of this kind: same vocabulary, same .bin/.idx prefix
    other = TokenizerSpec(kind, str(different), spec.merges)
    assert load_tokenizer(other).vocab_size == VOCAB and different.read_bytes() != Path(spec.model).read_bytes()
    saved, now = identity_sha256(spec, cache), identity_sha256(other, cache)
    assert saved != now
    before = snapshot(run_dir)
    # first the .bin/.idx's own record of the tokenizer that made it (written by the preprocess command) refuses it
    record = json.loads(Path(f"{prefix}.tokenizer.json").read_text())
    assert (record["kind"], record["vocab_size"], record["files_sha256"]) == (kind, VOCAB, load_tokenizer(spec).files_sha256())
    refused = run_pretrain(data + [f"data.tokenizer_model={q(different)}", "train.steps=4"])
    assert refused.returncode == EXIT_INPUT, (refused.stdout[-2000:], refused.stderr[-3000:])
    (line,) = [x for x in refused.stderr.splitlines() if x.strip()]
    assert line.startswith(f"error: {prefix}.bin was tokenized by another tokenizer than this run's: ") and (
        f"(sha256 {record['files_sha256'][:12]}), the run's is {kind} "
        f"{', '.join(str(f) for f in load_tokenizer(other).files)} of {VOCAB} ids (sha256 "
        f"{load_tokenizer(other).files_sha256()[:12]}) (data.blend): name the tokenizer that made it") in line, line
    assert snapshot(run_dir) == before
    # files made elsewhere carry no record: said on stdout, and then the checkpoint's own tokenizer hash refuses it
    Path(f"{prefix}.tokenizer.json").unlink()
    refused = run_pretrain(data + [f"data.tokenizer_model={q(different)}", "train.steps=4"])
    assert refused.returncode == EXIT_INPUT, (refused.stdout[-2000:], refused.stderr[-3000:])
    assert f"note: data.blend prefix {prefix} has no tokens.tokenizer.json" in refused.stdout, refused.stdout
    (line,) = [x for x in refused.stderr.splitlines() if x.strip()]
    # the tokenizer hash is the only difference named (the data prefix and the model are the run's own)
    assert line.startswith("error: checkpoint ") and (
        f"written for another model, tokenizer or data: tokenizer_sha256: saved '{saved}', now '{now}'. "
        "Resume with the same ones") in line, line
    assert snapshot(run_dir) == before  # a refused start writes nothing

    # export --format hf finds the tokenizer the checkpoint recorded: AutoTokenizer gives the run's ids; naming the
    # other file instead is refused by the same hash, in one line, exit 3, nothing written
    from transformers import AutoTokenizer

    from pretrain.checkpoint.export import main as export_main
    from test_tokenizer_kinds import DOCUMENTS
    assert export_main([str(run_dir / "checkpoints"), str(tmp_path / "hf"), "--format", "hf"]) == 0
    documents = [d for d, _ in zip(read_documents(CORPUS), range(DOCUMENTS))]
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert [exported(d).input_ids for d in documents] == load_tokenizer(spec).encode_batch(documents)
    capsys.readouterr()
    assert export_main([str(run_dir / "checkpoints"), str(tmp_path / "hf2"), "--format", "hf",
                        "--tokenizer", str(different)]) == EXIT_INPUT
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"tokenizer {different} is not the one" in err and "--no-tokenizer" in err, err
    assert not (tmp_path / "hf2").exists()

    # a checkpoint written before the manifest recorded its tokenizer and the config its architecture keys: the
    # tokenizer is the [data] keys' file, the model the GPT-2 those keys' defaults describe; the same export
    manifest_path = run_dir / "checkpoints" / "step_00000004" / "checkpoint.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["tokenizer"]
    for key in ("position_embedding", "rope_base", "rope_scaling_factor", "mlp", "norm", "norm_epsilon",
                "qk_layernorm", "bias", "num_query_groups"):
        manifest["config"]["model"].pop(key)
    manifest_path.write_text(json.dumps(manifest))
    assert export_main([str(run_dir / "checkpoints"), str(tmp_path / "hf_old"), "--format", "hf"]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf_old" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name


@pytest.mark.timeout(300)
def test_a_corpus_whose_text_column_is_not_text_trains_with_data_text_column(tmp_path, files):  # noqa: F811
    """A Parquet corpus whose documents are in column "content": without data.text_column the start is refused in one
    line naming the columns there; with it the run trains, on the tokens the preprocess command writes for the same
    documents from a JSONL's "text" field (byte for byte)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pretrain.data.preprocess import tokenize_corpus
    root, _ = files
    documents = list(read_documents(CORPUS))[:200]
    corpus = tmp_path / "corpus.parquet"
    pq.write_table(pa.table({"id": list(range(len(documents))), "content": documents}), corpus, row_group_size=64)
    tokenizer = TokenizerSpec("hf", str(root / "tokenizer.json"))
    args = [f"data.corpus={q(corpus)}", 'data.tokenizer_kind="hf"', f"data.tokenizer_model={q(tokenizer.model)}",
            f"data.cache_dir={q(tmp_path / 'cache')}", f"logging.run_dir={q(tmp_path / 'run')}", "train.steps=2"]
    refused = run_pretrain(args)
    assert refused.returncode == EXIT_INPUT and refused.stderr.strip() == (
        f"error: corpus '{corpus}' has no column 'text' (data): its columns: id, content (choose one with "
        "--text-column, or data.text_column)"), refused.stderr
    assert not (tmp_path / "run").exists()
    ran = run_pretrain(args + ['data.text_column="content"'])
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "step 2/2 | loss" in ran.stdout
    (tmp_path / "same.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    tokenize_corpus([tmp_path / "same.jsonl"], tokenizer, tmp_path / "reference", workers=1)
    (built,) = (tmp_path / "cache").glob("tokens-*.bin")
    assert built.read_bytes() == (tmp_path / "reference.bin").read_bytes()
