"""Tests data made elsewhere: .bin/.idx with no tokenizer (kind "none"), and Parquet / Arrow IPC corpora."""
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.datasets.utils import get_blend_from_list
from tokenizers import ByteLevelBPETokenizer

from pretrain.config import DataConfig
from pretrain.data import preprocess as preprocess_cli
from pretrain.data.corpus import read_documents
from pretrain.errors import DataError, TokenizerError
from pretrain.data.datasets import open_datasets, prepare_files
from pretrain.data.preprocess import tokenize_corpus
from pretrain.data.tokenizers import TokenizerSpec

pytestmark = pytest.mark.one_core  # one process, tens of seconds: the side lane (tools/run_suite.py)

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus.jsonl"
REPO = Path(__file__).resolve().parents[2]
VOCAB, EOD, SEQ = 1000, 999, 32


def write_megatron(prefix: Path, documents: list[numpy.ndarray], dtype) -> str:
    """.bin/.idx written with numpy and megatron-core's own builder, as a tool outside zero3d would."""
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for document in documents:
        builder.add_document(torch.from_numpy(document.astype(dtype)), [document.size])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def random_documents(count: int, seed: int = 0) -> list[numpy.ndarray]:
    rng = numpy.random.default_rng(seed)
    return [numpy.append(rng.integers(0, EOD, rng.integers(10, 200)), EOD) for _ in range(count)]


def test_megatron_files_open_with_no_tokenizer(tmp_path, world):
    prefix = write_megatron(tmp_path / "made", random_documents(300), numpy.uint16)
    config = DataConfig(tokenizer_kind="none", eod_id=EOD, blend=prefix, cache_dir=str(tmp_path / "cache"))
    files = prepare_files(config, VOCAB)
    train, valid, tokenizer = open_datasets(files, config, SEQ, 1234, VOCAB, 500, 20)
    assert (tokenizer.kind, tokenizer.vocab_size, tokenizer.eod_id, tokenizer.model_path) == ("none", VOCAB, EOD, None)
    reference = GPTDatasetConfig(
        random_seed=1234, sequence_length=SEQ, blend=get_blend_from_list([prefix]), split="95,5,0",
        path_to_cache=str(tmp_path / "megatron"),
        tokenizer=SimpleNamespace(vocab_size=VOCAB, eod=EOD, pad=-1, unique_identifiers={"reference": 1}),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    theirs, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [500, 20, 0], lambda: True, reference).build()
    assert len(train) == len(theirs) and valid is not None
    for i in range(0, len(train), 7):
        assert torch.equal(train.sample(i)[:-1], theirs[i]["tokens"])
    assert Path(files.tokenizer_path).parent == tmp_path / "cache"  # what a checkpoint's identity hashes
    assert json.loads(Path(files.tokenizer_path).read_text())["eod_id"] == EOD


def test_ids_outside_the_vocabulary_and_dtypes_are_refused_before_training(tmp_path):
    documents = random_documents(20, seed=1)
    documents[7][3] = VOCAB  # one id past the vocabulary, in document 7
    prefix = write_megatron(tmp_path / "bad", documents, numpy.uint16)
    position = sum(d.size for d in documents[:7]) + 3
    config = dict(tokenizer_kind="none", eod_id=EOD, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=rf"bad\.bin holds token id {VOCAB} \(document 7, token {position} of the "
                                        rf"file\) but the tokenizer has {VOCAB} ids \(0\.\.{VOCAB - 1}\)"):
        prepare_files(DataConfig(blend=prefix, **config), VOCAB)
    negative = write_megatron(tmp_path / "negative", [numpy.array([5, -1, EOD])], numpy.int32)
    with pytest.raises(DataError, match=r"negative\.bin holds token id -1 \(document 0, token 1 of the file\)"):
        prepare_files(DataConfig(blend=negative, **config), VOCAB)
    narrow = write_megatron(tmp_path / "narrow", random_documents(5), numpy.uint16)
    with pytest.raises(DataError, match=r"narrow\.bin stores uint16 token ids \(at most 65535\) but the vocabulary "
                                        r"has 70000 ids \(0\.\.69999\): it was made with another, smaller tokenizer"):
        prepare_files(DataConfig(blend=narrow, **config), 70_000)
    prepare_files(DataConfig(blend=narrow, **config), 65_536)  # uint16 holds 0..65535
    floats = write_megatron(tmp_path / "floats", random_documents(5), numpy.float32)
    with pytest.raises(DataError, match=r"floats\.bin stores float32 values, not integer token ids"):
        prepare_files(DataConfig(blend=floats, **config), VOCAB)
    with pytest.raises(TokenizerError, match=r"data\.eod_id = 1000 is outside the vocabulary 0\.\.999"):
        prepare_files(DataConfig(blend=narrow, **{**config, "eod_id": VOCAB}), VOCAB)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Part of the shipped corpus as JSONL, Parquet (small row groups), Arrow IPC file and stream, and a
    byte-level BPE (tokenizers) to tokenize it with."""
    root = tmp_path_factory.mktemp("columnar")
    documents = list(read_documents(CORPUS))[:300]
    (root / "part.jsonl").write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(documents)))
    table = pa.table({"id": list(range(len(documents))), "text": documents})
    pq.write_table(table, root / "part.parquet", row_group_size=16, compression="NONE")
    with pa.ipc.new_file(root / "part.arrow", table.schema) as writer:
        for batch in table.to_batches(max_chunksize=25):
            writer.write_batch(batch)
    with pa.ipc.new_stream(root / "stream.arrow", table.schema) as writer:
        writer.write_table(table, max_chunksize=40)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(documents[:50], vocab_size=399, show_progress=False)
    bpe.add_special_tokens(["<|endoftext|>"])
    bpe.save(str(root / "tokenizer.json"))
    return SimpleNamespace(root=root, documents=documents, spec=TokenizerSpec("hf", str(root / "tokenizer.json")))


def test_parquet_and_arrow_give_the_same_bytes_as_jsonl(tmp_path, corpus):
    tokenize_corpus([corpus.root / "part.jsonl"], corpus.spec, tmp_path / "jsonl")
    expected = {suffix: (tmp_path / f"jsonl{suffix}").read_bytes() for suffix in (".bin", ".idx")}
    for name, workers in (("part.parquet", 2), ("part.arrow", 1), ("stream.arrow", 1)):
        stats = tokenize_corpus([corpus.root / name], corpus.spec, tmp_path / name, workers=workers,
                                chunk_bytes=20_000)
        assert stats.documents == len(corpus.documents)
        for suffix, data in expected.items():
            assert (tmp_path / f"{name}{suffix}").read_bytes() == data, (name, suffix)
    assert list(read_documents(corpus.root / "part.parquet")) == corpus.documents


def test_a_parquet_file_larger_than_the_memory_cap_streams(tmp_path, corpus):
    """pyarrow's peak allocation while reading stays a fraction of the file: record batches, not the table."""
    big = tmp_path / "big.parquet"
    table = pq.read_table(corpus.root / "part.parquet")
    with pq.ParquetWriter(big, table.schema, compression="NONE") as writer:
        for _ in range(8):
            writer.write_table(table, row_group_size=16)
    cap = 1_000_000
    assert big.stat().st_size > cap
    script = ("import sys, pyarrow as pa\nfrom pathlib import Path\nfrom pretrain.data.corpus import read_chunks\n"
              "rows = sum(len(c.lines) for c in read_chunks([Path(sys.argv[1])], 50_000))\n"
              "print(rows, pa.default_memory_pool().max_memory())")
    run = subprocess.run([sys.executable, "-c", script, str(big)], capture_output=True, text=True, cwd=REPO,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, check=True)
    rows, peak = map(int, run.stdout.split())
    assert rows == 8 * len(corpus.documents) and peak < cap, (rows, peak, big.stat().st_size)
    stats = tokenize_corpus([big], corpus.spec, tmp_path / "big", workers=2, chunk_bytes=50_000)
    assert stats.documents == 8 * len(corpus.documents)


def test_bad_columnar_inputs_are_one_line_and_write_nothing(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    def run(path, *extra):
        code = preprocess_cli.main(["--input", str(path), "--tokenizer-kind", "hf", "--tokenizer-model",
                                    corpus.spec.model, "--output-prefix", str(out / "x"), "--workers", "1", *extra])
        return code, capsys.readouterr().err.strip()
    code, err = run(tmp_path / "absent.parquet")
    assert code == 3 and err.endswith("absent.parquet' does not exist") and len(err.splitlines()) == 1
    code, err = run(corpus.root / "part.parquet", "--text-column", "body")
    assert code == 3 and err.endswith("has no column 'body'; its columns: id, text (choose one with --text-column, "
                                      "or data.text_column)")
    code, err = run(corpus.root / "stream.arrow", "--text-column", "body")
    assert code == 3 and "has no column 'body'; its columns: id, text" in err
    code, err = run(corpus.root / "part.parquet", "--text-column", "id")
    assert code == 3 and err.endswith("column 'id' of corpus '" + str(corpus.root / "part.parquet") +
                                      "' holds int64, not text (string or binary)")
    pq.write_table(pa.table({"text": pa.array([b"fine", b"caf\xe9"], pa.binary())}), tmp_path / "latin1.parquet")
    code, err = run(tmp_path / "latin1.parquet")
    assert code == 3 and err.endswith("latin1.parquet: row 1 (0-based) of column 'text': not UTF-8 text "
                                      "(unexpected end of data at byte 3)")
    pq.write_table(pa.table({"text": ["fine", None]}), tmp_path / "null.parquet")
    code, err = run(tmp_path / "null.parquet")
    assert code == 3 and err.endswith("null.parquet: row 1 (0-based) has no text: column 'text' is null there")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 not really")
    code, err = run(tmp_path / "junk.parquet")
    assert code == 3 and "junk.parquet' cannot be read as Parquet: " in err and len(err.splitlines()) == 1
    assert not out.exists() or list(out.iterdir()) == []  # nothing written, not even half
