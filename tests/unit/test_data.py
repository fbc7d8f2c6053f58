"""Tests the corpus-to-tokens path: tokenizer, parallel preprocessing, .bin/.idx interop, every error message."""
import gzip
import os
import shutil
from pathlib import Path

import numpy
import pytest
import torch
import zstandard
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from pretrain.data import preprocess as preprocess_cli
from pretrain.data.corpus import read_documents
from pretrain.data.indexed import check_indexed_dataset, check_token_ids
from pretrain.data.preprocess import sample_sentences, tokenize_corpus, train_tokenizer
from pretrain.data.tokenizers import Tokenizer
from pretrain.errors import DataError, TokenizerError

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus.jsonl"
VOCAB = 400  # byte fallback (256) + 3 specials + this corpus's characters need 350; the rest are merges


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tokenizer trained on the shipped corpus and the corpus tokenized with it."""
    root = tmp_path_factory.mktemp("built")
    tokenizer = Tokenizer(train_tokenizer(CORPUS, root / "tok", VOCAB))
    prefix = str(root / "tokens")
    tokenize_corpus([CORPUS], tokenizer.model_path, prefix)
    documents = [tokenizer.encode(text) + [tokenizer.eod_id] for text in read_documents(CORPUS)]
    return tokenizer, prefix, documents


def copy_prefix(prefix: str, directory: Path) -> str:
    for suffix in (".bin", ".idx"):
        shutil.copy(prefix + suffix, directory / f"copy{suffix}")
    return str(directory / "copy")


def corpus_lines() -> list[str]:
    return CORPUS.read_text().splitlines(keepends=True)


def test_shipped_corpus_is_real_english_jsonl():
    documents = list(read_documents(CORPUS))
    assert len(documents) == 643
    assert 500_000 < CORPUS.stat().st_size < 1_500_000
    assert documents[0].startswith('The "assert" statement\n')


def test_tokenizer_round_trips_text(built):
    tokenizer, _, _ = built
    assert tokenizer.vocab_size == VOCAB and tokenizer.eod_id == 2
    samples = ["The quick brown fox jumps over the lazy dog.",
               "  def f(x):\n\treturn x ** 2  # leading spaces, tab, newline\n\n",
               "Non-ASCII falls back to bytes: naïve café — 日本語 ✓"]
    for text in samples + list(read_documents(CORPUS))[:50]:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_training_is_deterministic_and_atomic(tmp_path, built):
    again = train_tokenizer(CORPUS, tmp_path / "again", VOCAB)
    assert again.read_bytes() == built[0].model_path.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.model"]  # no temporary left behind


def test_tokenizer_trains_on_a_bounded_sample_of_sentences(tmp_path, built):
    sample = sample_sentences((f"s{i}" for i in range(100_000)), 1000)
    numbers = [int(s[1:]) for s in sample]
    assert len(sample) == 1000 and numbers == sorted(numbers)  # bounded, kept in corpus order
    assert sample == sample_sentences((f"s{i}" for i in range(100_000)), 1000)  # seeded
    assert 45_000 < numpy.mean(numbers) < 55_000 and max(numbers) > 95_000  # drawn from all of it
    assert sample_sentences(["a", "b"], 1000) == ["a", "b"]  # a small corpus is used whole
    bounded = train_tokenizer(CORPUS, tmp_path / "bounded", VOCAB, max_sentences=3000)
    assert bounded.read_bytes() != built[0].model_path.read_bytes()
    assert Tokenizer(bounded).vocab_size == VOCAB


def test_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer model '.*missing\.model' does not exist"):
        Tokenizer(tmp_path / "missing.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(TokenizerError, match=r"tokenizer model '.*junk\.model' is not a sentencepiece model"):
        Tokenizer(tmp_path / "junk.model")
    (tmp_path / "junk.model").unlink()
    with pytest.raises(TokenizerError, match=r"vocab_size 100000 is too large for corpus '.*corpus\.jsonl': "
                                             r"sentencepiece can learn at most \d+ pieces"):
        train_tokenizer(CORPUS, tmp_path / "big", 100_000)
    with pytest.raises(TokenizerError, match=r"vocab_size 300 is too small .* need at least 350"):
        train_tokenizer(CORPUS, tmp_path / "small", 300)
    assert list(tmp_path.iterdir()) == []


def test_files_written_here_are_read_by_megatron(built):
    tokenizer, prefix, documents = built
    megatrons = IndexedDataset(prefix)
    assert len(megatrons) == len(documents)
    assert [megatrons[i].tolist() for i in range(len(megatrons))] == documents
    assert megatrons[0].dtype == numpy.uint16
    index = check_indexed_dataset(prefix)
    assert index.sequence_lengths.tolist() == [len(d) for d in documents]


def test_megatron_builder_writes_the_same_bytes(tmp_path, built):
    """What Megatron-LM's preprocess_data does (one document a sequence, EOD appended, uint16)."""
    _, prefix, documents = built
    builder = IndexedDatasetBuilder(str(tmp_path / "megatron.bin"), dtype=numpy.uint16)
    for document in documents:
        builder.add_document(torch.tensor(document), [len(document)])
    builder.finalize(str(tmp_path / "megatron.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"megatron{suffix}").read_bytes() == Path(prefix + suffix).read_bytes()


def split_corpus(directory: Path) -> None:
    """The shipped corpus as three files: plain, gzip and zstd (of two frames)."""
    lines = corpus_lines()
    third = len(lines) // 3
    (directory / "part1.jsonl").write_text("".join(lines[:third]))
    (directory / "part2.jsonl.gz").write_bytes(gzip.compress("".join(lines[third:2 * third]).encode()))
    frames = [zstandard.ZstdCompressor().compress("".join(part).encode())  # two frames, as pzstd writes
              for part in (lines[2 * third:-100], lines[-100:])]
    (directory / "part3.jsonl.zst").write_bytes(b"".join(frames))


def test_parallel_preprocess_of_compressed_globs_writes_the_same_files(tmp_path, built):
    tokenizer, prefix, documents = built
    split_corpus(tmp_path)
    stats = tokenize_corpus([str(tmp_path / "part*")], tokenizer.model_path, tmp_path / "out" / "parallel",
                            workers=2, chunk_bytes=50_000)
    assert (stats.files, stats.documents, stats.empty, stats.tokens) == (3, 643, 0, sum(map(len, documents)))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / "out" / f"parallel{suffix}").read_bytes() == Path(prefix + suffix).read_bytes()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["parallel.bin", "parallel.idx"]


def test_progress_is_logged_when_not_interactive(tmp_path, built, capsys):
    tokenize_corpus([CORPUS], built[0].model_path, tmp_path / "logged", progress="log", log_interval_s=0,
                    chunk_bytes=200_000)
    lines = capsys.readouterr().err.splitlines()
    size = CORPUS.stat().st_size / 1e6
    assert len(lines) == 4 and all(line.startswith("preprocess: ") for line in lines)
    assert lines[-1].startswith(f"preprocess: {size:,.1f}/{size:,.1f} MB (100%), 643 documents, ")
    assert all(" tokens, " in line and " MB/s, ETA " in line for line in lines)
    tokenize_corpus([CORPUS], built[0].model_path, tmp_path / "bar", progress="bar")
    assert "preprocess: 100%" in capsys.readouterr().err


def test_empty_documents_are_skipped_and_counted(tmp_path, built):
    (tmp_path / "some.jsonl").write_text('{"text": "one"}\n{"text": "  "}\n\n{"text": ""}\n{"text": "two"}\n')
    stats = tokenize_corpus([tmp_path / "some.jsonl"], built[0].model_path, tmp_path / "some")
    assert (stats.documents, stats.empty) == (2, 2)
    assert len(IndexedDataset(str(tmp_path / "some"))) == 2


def test_an_interrupted_preprocess_leaves_no_complete_looking_file(tmp_path, built, monkeypatch):
    (tmp_path / "late.jsonl").write_text("".join(corpus_lines()[:300]) + '{"text": broken\n')
    with pytest.raises(DataError, match=r"late\.jsonl:301: invalid JSON \(Expecting value at column 10\)"):
        tokenize_corpus([tmp_path / "late.jsonl"], built[0].model_path, tmp_path / "out" / "late", workers=2,
                        chunk_bytes=20_000)
    assert list((tmp_path / "out").iterdir()) == []
    calls = []

    def interrupt(self, tokens):
        calls.append(1)
        if len(calls) == 100:
            raise KeyboardInterrupt
    monkeypatch.setattr("pretrain.data.indexed.IndexedWriter.add_document", interrupt)
    with pytest.raises(KeyboardInterrupt):
        tokenize_corpus([CORPUS], built[0].model_path, tmp_path / "out" / "stopped")
    assert list((tmp_path / "out").iterdir()) == []


def test_corpus_errors(tmp_path):
    with pytest.raises(DataError, match=r"corpus '.*absent\.jsonl' does not exist"):
        list(read_documents(tmp_path / "absent.jsonl"))
    with pytest.raises(DataError, match=r"corpus pattern '.*nothing-\*\.jsonl' matches no file"):
        list(read_documents(str(tmp_path / "nothing-*.jsonl")))
    (tmp_path / "notes.txt").write_text("text\n")
    with pytest.raises(DataError, match=r"corpus '.*notes\.txt' is not JSONL, Parquet or Arrow: expected one of \.jsonl, "):
        list(read_documents(tmp_path / "notes.txt"))
    (tmp_path / "empty.jsonl").write_text('{"text": "  "}\n\n{"text": ""}\n')
    with pytest.raises(DataError, match=r"corpus .*empty\.jsonl has no non-empty document"):
        list(read_documents(tmp_path / "empty.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON \(Expecting value at column 10\)"):
        list(read_documents(tmp_path / "bad.jsonl"))
    (tmp_path / "notext.jsonl").write_text('{"text": "fine"}\n\n{"body": "x", "id": 3}\n')
    with pytest.raises(DataError, match=r"notext\.jsonl:3: no string 'text' field \(keys: 'body', 'id'\); "
                                        r"choose the field with --text-column \(data.text_column\)"):
        list(read_documents(tmp_path / "notext.jsonl"))
    (tmp_path / "body.jsonl").write_text('{"body": "x", "id": 3}\n')
    assert list(read_documents(tmp_path / "body.jsonl", key="body")) == ["x"]
    (tmp_path / "list.jsonl").write_text('["text"]\n')
    with pytest.raises(DataError, match=r"list\.jsonl:1: expected a JSON object with a string 'text' field, "
                                        r"got a JSON list"):
        list(read_documents(tmp_path / "list.jsonl"))
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1\.jsonl:1: not UTF-8 text \(invalid continuation byte at "
                                        r"byte 13\)"):
        list(read_documents(tmp_path / "latin1.jsonl"))
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"corpus '.*broken\.jsonl\.gz' cannot be decompressed: "):
        list(read_documents(tmp_path / "broken.jsonl.gz"))
    (tmp_path / "cut.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "x"}\n' * 999)[:-20])
    with pytest.raises(DataError, match=r"corpus '.*cut\.jsonl\.zst' cannot be decompressed: "):
        list(read_documents(tmp_path / "cut.jsonl.zst"))


def test_cli_trains_tokenizer_and_writes_the_same_tokens(tmp_path, built, capsys):
    model, out = tmp_path / "cli.model", tmp_path / "out" / "cli"
    assert preprocess_cli.main(["--input", str(CORPUS), "--tokenizer-model", str(model), "--output-prefix",
                                str(out), "--train-tokenizer", "--vocab-size", str(VOCAB), "--workers", "2"]) == 0
    assert model.read_bytes() == built[0].model_path.read_bytes()
    assert Path(f"{out}.bin").read_bytes() == Path(f"{built[1]}.bin").read_bytes()
    assert "from 1 file(s): 643 documents (0 empty skipped)" in capsys.readouterr().out
    assert preprocess_cli.main(["--input", str(tmp_path / "none.jsonl"), "--tokenizer-model", str(model),
                                "--output-prefix", str(out)]) == 3
    assert "none.jsonl' does not exist" in capsys.readouterr().err


def test_damaged_indexed_datasets_are_rejected(tmp_path, built):
    prefix = copy_prefix(built[1], tmp_path)
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    good_idx, good_bin = idx.read_bytes(), bin_.read_bytes()
    idx.write_bytes(good_idx[:-8])
    with pytest.raises(DataError, match=rf"copy\.idx is truncated or corrupt: its header describes 643 "
                                        rf"sequences and 644 document indices, which take {len(good_idx)} "
                                        rf"bytes, but the file has {len(good_idx) - 8} bytes"):
        check_indexed_dataset(prefix)
    idx.write_bytes(b"NOTANIDX\x00" + good_idx[9:])
    with pytest.raises(DataError, match=r"copy\.idx is not a Megatron index: "
                                        r"header b'NOTANIDX\\x00' is not b'MMIDIDX"):
        check_indexed_dataset(prefix)
    idx.write_bytes(good_idx)
    bin_.write_bytes(good_bin[:-2])
    with pytest.raises(DataError, match=rf"copy\.bin is shorter than its index says: .*copy\.idx describes "
                                        rf"{len(good_bin) // 2} tokens of uint16 \({len(good_bin)} bytes\), but "
                                        rf"the file has {len(good_bin) - 2} bytes"):
        check_indexed_dataset(prefix)
    bin_.write_bytes(good_bin + b"\0\0")
    with pytest.raises(DataError, match=r"copy\.bin is longer than its index says"):
        check_indexed_dataset(prefix)
    os.remove(bin_)
    with pytest.raises(DataError, match=r"indexed dataset '.*copy' is incomplete: .*copy\.bin does not exist"):
        check_indexed_dataset(prefix)


def test_token_ids_outside_the_tokenizer_are_refused(built):
    _, prefix, documents = built
    check_token_ids(prefix, VOCAB)
    largest = max(max(d) for d in documents)
    stream = [t for d in documents for t in d]
    first_bad = next(i for i, t in enumerate(stream) if t >= 300)
    bad_document = next(n for n, d in enumerate(documents) if max(d) >= 300)
    with pytest.raises(DataError, match=rf"tokens\.bin holds token id {stream[first_bad]} \(document {bad_document}, "
                                        rf"token {first_bad} of the file\) "
                                        r"but the tokenizer has 300 ids \(0\.\.299\): the \.bin/\.idx was made "
                                        r"with another, larger tokenizer"):
        check_token_ids(prefix, 300)
    check_token_ids(prefix, 300, limit=first_bad)  # the scan is bounded; TokenBlocks checks the rest
    assert largest < VOCAB
