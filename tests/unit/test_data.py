"""Tests the data pipeline: tokenizer, .bin/.idx round trip, GPT samples and splits, every error message."""
import json
import os
import shutil
from pathlib import Path

import numpy
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from pretrain import preprocess as preprocess_cli
from pretrain.data import (DataError, build_gpt_datasets, check_indexed_dataset, load_indexed_dataset,
                           prepare_data, prepare_files, preprocess, read_documents)
from pretrain.tokenizer import Tokenizer, TokenizerError, train_tokenizer

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus.jsonl"
VOCAB = 400  # byte fallback (256) + 3 specials + this corpus's characters need 350; the rest are merges
SEQ = 32


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tokenizer trained on the shipped corpus and the corpus tokenized with it."""
    root = tmp_path_factory.mktemp("built")
    tokenizer = Tokenizer(train_tokenizer(CORPUS, root / "tok", VOCAB))
    prefix = preprocess(CORPUS, tokenizer, root / "tokens")
    documents = [tokenizer.encode(text) + [tokenizer.eod_id] for text in read_documents(CORPUS)]
    return tokenizer, prefix, documents


def copy_prefix(prefix: str, directory: Path) -> str:
    for suffix in (".bin", ".idx"):
        shutil.copy(prefix + suffix, directory / f"copy{suffix}")
    return str(directory / "copy")


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


def test_bin_idx_round_trip_gives_identical_tokens(built):
    tokenizer, prefix, documents = built
    ours, megatrons = load_indexed_dataset(prefix), IndexedDataset(prefix)
    assert len(ours) == len(megatrons) == len(documents)
    assert [ours[i].tolist() for i in range(len(ours))] == documents
    assert [megatrons[i].tolist() for i in range(len(megatrons))] == documents
    assert megatrons[0].dtype == numpy.uint16
    index = check_indexed_dataset(prefix)
    assert index.sequence_lengths.tolist() == [len(d) for d in documents]


def test_cli_trains_tokenizer_and_writes_the_same_tokens(tmp_path, built, capsys):
    model, out = tmp_path / "cli.model", tmp_path / "out" / "cli"
    assert preprocess_cli.main(["--input", str(CORPUS), "--tokenizer-model", str(model), "--output-prefix",
                                str(out), "--train-tokenizer", "--vocab-size", str(VOCAB)]) == 0
    assert model.read_bytes() == built[0].model_path.read_bytes()
    assert Path(f"{out}.bin").read_bytes() == Path(f"{built[1]}.bin").read_bytes()
    assert "643 documents" in capsys.readouterr().out
    assert preprocess_cli.main(["--input", str(tmp_path / "none.jsonl"), "--tokenizer-model", str(model),
                                "--output-prefix", str(out)]) == 1
    assert "none.jsonl' does not exist" in capsys.readouterr().err


def test_samples_are_windows_of_the_token_stream(built):
    _, prefix, documents = built
    train, valid = build_gpt_datasets(prefix, SEQ, 0.05, seed=7, model_vocab_size=VOCAB)
    num_train_docs = round(0.95 * len(documents))
    for dataset, docs in ((train, documents[:num_train_docs]), (valid, documents[num_train_docs:])):
        stream = [t for doc in docs for t in doc]
        assert len(dataset) == (len(stream) - 1) // SEQ
        windows = [dataset.window(k).tolist() for k in range(len(dataset))]
        assert all(len(w) == SEQ + 1 for w in windows)
        assert [t for w in windows for t in w[:-1]] == stream[:len(dataset) * SEQ]
        assert all(a[-1] == b[0] for a, b in zip(windows, windows[1:]))
    assert [v.tolist() for v in valid] == [valid.window(k).tolist() for k in range(len(valid))]  # unshuffled
    assert valid[0].dtype == train[0].dtype == torch.int64


def test_split_is_disjoint_deterministic_and_reshuffled_per_epoch(built):
    _, prefix, _ = built
    train, valid = build_gpt_datasets(prefix, SEQ, 0.05, seed=7, model_vocab_size=VOCAB)
    assert train.token_start + train.token_count == valid.token_start  # split by documents, no overlap
    again, _ = build_gpt_datasets(prefix, SEQ, 0.05, seed=7, model_vocab_size=VOCAB)
    n = len(train)
    order = [train.sample(i).tolist() for i in range(2 * n)]
    assert order == [again.sample(i).tolist() for i in range(2 * n)]
    for epoch in (0, 1):
        permutation = numpy.random.RandomState(7 + epoch).permutation(n)
        assert order[epoch * n:(epoch + 1) * n] == [train.window(int(k)).tolist() for k in permutation]
    assert order[:n] != order[n:] and sorted(order[:n]) == sorted(order[n:])
    assert [train[i].tolist() for i in range(n)] == order[:n]
    with pytest.raises(IndexError, match=f"sample {n} is out of range for {n} samples"):
        train[n]
    other, _ = build_gpt_datasets(prefix, SEQ, 0.05, seed=8, model_vocab_size=VOCAB)
    assert [other.sample(i).tolist() for i in range(n)] != order[:n]


def test_prepare_data_builds_once_into_a_relative_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(CORPUS.read_text().splitlines(keepends=True)[:200]))
    train, valid, tokenizer = prepare_data(str(corpus), None, None, "cache", VOCAB, SEQ, 0.1, seed=1)
    built_files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert [name.split("-")[0] for name in built_files] == ["tokenizer", "tokens", "tokens"]
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()}
    tokenizer_path, prefix = prepare_files(str(corpus), None, None, "cache", VOCAB)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()} == stamps  # reused, not rebuilt
    assert tokenizer_path == Path("cache") / built_files[0] and tokenizer.vocab_size == VOCAB
    assert len(train) > 0 and len(valid) > 0
    good_bin = Path(f"{prefix}.bin").read_bytes()
    Path(f"{prefix}.bin").write_bytes(good_bin[:100])  # as if a build was interrupted: detected and redone
    assert prepare_files(str(corpus), str(tokenizer_path), None, "cache", VOCAB) == (tokenizer_path, prefix)
    assert Path(f"{prefix}.bin").read_bytes() == good_bin
    with corpus.open("a") as out:
        out.write(json.dumps({"text": "One more document changes the cache key."}) + "\n")
    assert prepare_files(str(corpus), None, None, "cache", VOCAB)[1] != prefix
    assert len(list((tmp_path / "cache").iterdir())) == 6  # a second tokenizer and token pair


def test_corpus_errors(tmp_path):
    with pytest.raises(DataError, match=r"corpus '.*absent\.jsonl' does not exist"):
        list(read_documents(tmp_path / "absent.jsonl"))
    (tmp_path / "empty.jsonl").write_text('{"text": "  "}\n\n{"text": ""}\n')
    with pytest.raises(DataError, match=r"corpus '.*empty\.jsonl' has no non-empty document"):
        list(read_documents(tmp_path / "empty.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON \(Expecting value\)"):
        list(read_documents(tmp_path / "bad.jsonl"))
    (tmp_path / "notext.jsonl").write_text('{"text": "fine"}\n\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r'notext\.jsonl:3: expected an object with a string "text" field'):
        list(read_documents(tmp_path / "notext.jsonl"))
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=r"corpus '.*latin1\.jsonl' is not UTF-8 text: "):
        list(read_documents(tmp_path / "latin1.jsonl"))
    (tmp_path / "docs.txt").write_text("First document,\ntwo lines.\n\n  \n\nSecond one.\n")
    assert list(read_documents(tmp_path / "docs.txt")) == ["First document,\ntwo lines.", "Second one."]


def test_tokenizer_vocabulary_larger_than_model_is_refused_first(tmp_path, built):
    tokenizer, _, _ = built
    with pytest.raises(DataError, match=r"tokenizer vocabulary 400 is larger than model.vocab_size 256; "):
        prepare_files(tmp_path / "absent.jsonl", str(tokenizer.model_path), None, tmp_path / "cache", 256)
    assert not (tmp_path / "cache").exists()  # refused before reading the corpus or building anything
    # A .bin made by a larger tokenizer opens (scanning it all would be slow) but no sample gets out.
    train, _ = build_gpt_datasets(built[1], SEQ, 0.05, seed=1, model_vocab_size=300)
    with pytest.raises(DataError, match=r"token id \d+ in .*tokens\.bin is outside model.vocab_size 300; "):
        [train.window(k) for k in range(len(train))]


def test_validation_split_too_small(built):
    with pytest.raises(DataError, match=r"validation split is empty: 32 of 643 documents \(\d+ tokens\) "
                                        r"at valid_fraction 0.05 give no sample of seq_length \+ 1 = 100001 "
                                        r"tokens"):
        build_gpt_datasets(built[1], 100_000, 0.05, seed=1, model_vocab_size=VOCAB)


def test_damaged_indexed_datasets_are_rejected(tmp_path, built):
    prefix = copy_prefix(built[1], tmp_path)
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    good_idx, good_bin = idx.read_bytes(), bin_.read_bytes()
    idx.write_bytes(good_idx[:-8])
    with pytest.raises(DataError, match=rf"copy\.idx is truncated or corrupt: its header describes 643 "
                                        rf"sequences and 644 document indices, which take {len(good_idx)} "
                                        rf"bytes, but the file has {len(good_idx) - 8} bytes"):
        load_indexed_dataset(prefix)
    idx.write_bytes(b"NOTANIDX\x00" + good_idx[9:])
    with pytest.raises(DataError, match=r"copy\.idx is not a Megatron index: "
                                        r"header b'NOTANIDX\\x00' is not b'MMIDIDX"):
        load_indexed_dataset(prefix)
    idx.write_bytes(good_idx)
    bin_.write_bytes(good_bin[:-2])
    with pytest.raises(DataError, match=rf"copy\.bin is truncated or corrupt: .*copy\.idx describes "
                                        rf"{len(good_bin) // 2} tokens of uint16, expected {len(good_bin)} "
                                        rf"bytes, but the file has {len(good_bin) - 2} bytes"):
        load_indexed_dataset(prefix)
    os.remove(bin_)
    with pytest.raises(DataError, match=r"indexed dataset '.*copy' is incomplete: "
                                        r".*copy\.bin does not exist"):
        build_gpt_datasets(prefix, SEQ, 0.05, seed=1, model_vocab_size=VOCAB)
