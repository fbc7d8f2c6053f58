"""Tests GPT samples through megatron-core: Megatron's samples token for token, blends, splits, resume position."""
import json
import multiprocessing
from pathlib import Path
from types import SimpleNamespace

import numpy
import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from megatron.core.datasets.utils import get_blend_from_list

from pretrain.config import ConfigError, DataConfig, load_config
from pretrain.data.corpus import read_documents
from pretrain.errors import DataError
from pretrain.data.datasets import DataFiles, TokenBlocks, open_datasets, prepare_files
from pretrain.data.indexed import IndexedWriter
from pretrain.data.loader import Batches
from pretrain.data.preprocess import train_tokenizer
from pretrain.data.tokenizers import Tokenizer

CORPUS = Path(__file__).resolve().parents[2] / "data" / "corpus.jsonl"
VOCAB, SEQ = 400, 32


@pytest.fixture(scope="module")
def data(tmp_path_factory, world):
    """The corpus tokenized by megatron's own IndexedDatasetBuilder (as Megatron-LM's preprocess_data
    writes it), and two synthetic prefixes whose token ranges tell their samples apart."""
    root = tmp_path_factory.mktemp("data")
    tokenizer = Tokenizer(train_tokenizer(CORPUS, root / "tok", VOCAB))
    builder = IndexedDatasetBuilder(str(root / "megatron.bin"), dtype=numpy.uint16)
    for text in read_documents(CORPUS):
        document = tokenizer.encode(text) + [tokenizer.eod_id]
        builder.add_document(torch.tensor(document), [len(document)])
    builder.finalize(str(root / "megatron.idx"))
    rng = numpy.random.default_rng(0)
    for name, (low, high) in {"low": (3, 100), "high": (100, 200)}.items():
        with IndexedWriter(root / name, VOCAB) as writer:
            for _ in range(300):
                text = rng.integers(low, high, rng.integers(20, 300))
                writer.add_document(numpy.append(text, 2).astype(numpy.uint16))
            writer.finish()
    return SimpleNamespace(root=root, tokenizer=tokenizer, megatron=str(root / "megatron"),
                           low=str(root / "low"), high=str(root / "high"))


def open_run(data, cache: Path, train_samples: int, valid_samples: int = 16, seed: int = 1234, **fields):
    config = DataConfig(tokenizer_model=str(data.tokenizer.model_path), cache_dir=str(cache), **fields)
    files = prepare_files(config, VOCAB)
    return open_datasets(files, config, SEQ, seed, VOCAB, train_samples, valid_samples)


def origin(block: torch.Tensor) -> str:
    text = block[block != 2]
    assert bool((text < 100).all()) or bool((text >= 100).all()), "a sample mixes two prefixes"
    return "low" if bool((text < 100).all()) else "high"


def test_megatron_written_files_give_megatrons_samples_token_for_token(tmp_path, data):
    """Megatron-LM's pretrain_gpt on these files (its GPTDatasetConfig) trains on exactly our samples."""
    train, valid, _ = open_run(data, tmp_path / "ours", 3000, 40, blend=data.megatron)
    reference = GPTDatasetConfig(
        random_seed=1234, sequence_length=SEQ, blend=get_blend_from_list([data.megatron]), split="95,5,0",
        path_to_cache=str(tmp_path / "megatron"),
        tokenizer=SimpleNamespace(vocab_size=VOCAB, eod=2, pad=-1, unique_identifiers={"reference": 1}),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    megatron_train, megatron_valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [3000, 40, 0], lambda: True, reference).build()
    for ours, theirs in ((train, megatron_train), (valid, megatron_valid)):
        assert len(ours) == len(theirs) and len(ours) >= 40  # at least what was asked for
        for i in range(len(ours)):
            block, sample = ours.sample(i), theirs[i]
            assert block.shape == (SEQ + 1,) and block.dtype == torch.int64
            assert torch.equal(block[:-1], sample["tokens"]) and torch.equal(block[1:], sample["labels"])
    assert len(train) >= 3000
    assert not torch.equal(train.sample(0)[:8], torch.tensor(data.tokenizer.encode(next(read_documents(CORPUS)))[:8]))


def test_blend_yields_samples_in_proportion(tmp_path, data):
    train, valid, _ = open_run(data, tmp_path, 4000, 400, blend=f"0.25 {data.low} 0.75 {data.high}")
    origins = [origin(train.sample(i)) for i in range(4000)]
    assert abs(origins.count("low") / 4000 - 0.25) <= 0.02
    assert [Path(train.source(i)).name for i in range(200)] == origins[:200]
    valid_origins = {origin(valid.sample(i)) for i in range(400)}
    assert valid_origins == {"low", "high"}  # both prefixes contribute their own validation documents


def test_per_split_blends(tmp_path, data):
    train, valid, _ = open_run(data, tmp_path, 800, 50, train_blend=f"0.25 {data.low} 0.75 {data.high}",
                               valid_blend=data.low)
    assert {origin(valid.sample(i)) for i in range(50)} == {"low"}
    assert {origin(train.sample(i)) for i in range(100)} == {"low", "high"}


def test_split_caches_indices_and_builds_no_unread_split(tmp_path, data):
    train, valid, _ = open_run(data, tmp_path, 500, 20, blend=data.megatron, split="949,50,1")
    cached = sorted(p.name.split("-", 1)[1] for p in tmp_path.iterdir())
    assert cached == sorted(f"GPTDataset-{split}-{part}" for split in ("train", "valid")
                            for part in ("description.txt", "document_index.npy", "sample_index.npy",
                                         "shuffle_index.npy"))  # no test split: the run reads none
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    again, _, _ = open_run(data, tmp_path, 500, 20, blend=data.megatron, split="949,50,1")
    assert {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == stamps  # loaded, not rebuilt
    assert all(torch.equal(again.sample(i), train.sample(i)) for i in range(50))
    _, no_valid, _ = open_run(data, tmp_path, 500, 0, blend=data.megatron)
    assert no_valid is None
    with pytest.raises(DataError, match=r"validation split of .*megatron is too small: documents 643\.\.643 of "
                                        r"643 \(0 tokens\) at data\.split = '9999,1,0' give no sample of "
                                        r"seq_length \+ 1 = 33 tokens"):
        open_run(data, tmp_path, 500, 20, blend=data.megatron, split="9999,1,0")


def run_stream(train, steps: range, dp: int, **start) -> list[torch.Tensor]:
    cfg = load_config(None, ["train.steps=6", "train.global_batch_size=8", "train.micro_batch_size=2",
                             f"data.num_workers={start.pop('workers', 0)}"])
    ranks = [Batches(train, cfg.train, cfg.data, SimpleNamespace(dp_rank=r, grad_accum=2, device=torch.device("cpu")), **start)
             for r in range(dp)]
    out = [batches.get(step, micro) for step in steps for batches in ranks for micro in range(2)]
    for batches in ranks:
        batches.close()
    assert multiprocessing.active_children() == []  # close() ended the workers now, not at garbage collection
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_continues_the_sample_stream(tmp_path, data, workers):
    train, _, _ = open_run(data, tmp_path, 48, blend=data.megatron)
    assert len(train) > 48  # all six steps inside the first epoch
    whole = run_stream(train, range(6), 2, workers=workers)
    assert torch.equal(torch.cat(whole[:4]), torch.stack([train.sample(i) for i in range(8)]))  # step 0: 0..7
    resumed = run_stream(train, range(3, 6), 2, consumed_samples=24, start_step=3, workers=workers)
    assert all(torch.equal(a, b) for a, b in zip(resumed, whole[12:], strict=True))
    # The position comes from the checkpoint, not the step: a run whose batch changed continues there.
    moved = run_stream(train, range(3, 4), 1, consumed_samples=20, start_step=3, workers=workers)
    assert torch.equal(moved[0], torch.stack([train.sample(20), train.sample(21)]))


def test_prepare_files_builds_once_into_a_relative_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.jsonl").write_text("".join(CORPUS.read_text().splitlines(keepends=True)[:200]))
    config = DataConfig(corpus="corpus.jsonl", cache_dir="cache")
    files = prepare_files(config, VOCAB)
    built = sorted(p.name for p in (tmp_path / "cache").iterdir())
    # the tokenizer, the tokens' .bin and .idx, and the record of the tokenizer that made them
    assert [name.split("-")[0] for name in built] == ["tokenizer", "tokens", "tokens", "tokens"]
    assert built[3].endswith(".tokenizer.json")
    assert files.tokenizer_path == str(Path("cache") / built[0]) and files.blend == ([f"cache/{built[1][:-4]}"], None)
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()}
    assert prepare_files(config, VOCAB) == files
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()} == stamps  # reused, not rebuilt
    prefix = files.blend[0][0]
    good_bin = Path(f"{prefix}.bin").read_bytes()
    Path(f"{prefix}.bin").write_bytes(good_bin[:100])  # as if a build was interrupted: detected and redone
    assert prepare_files(config, VOCAB) == files and Path(f"{prefix}.bin").read_bytes() == good_bin
    with (tmp_path / "corpus.jsonl").open("a") as out:
        out.write(json.dumps({"text": "One more document changes the cache key."}) + "\n")
    assert prepare_files(config, VOCAB).blend != files.blend
    assert len(list((tmp_path / "cache").iterdir())) == 8  # a second tokenizer and tokens (.bin, .idx, record)


def test_tokenizers_that_do_not_fit_are_refused_first(tmp_path, data):
    with pytest.raises(DataError, match=r"tokenizer vocabulary 400 is larger than model.vocab_size 256; "):
        prepare_files(DataConfig(corpus=str(tmp_path / "absent.jsonl"), cache_dir=str(tmp_path / "cache"),
                                 tokenizer_model=str(data.tokenizer.model_path)), 256)
    assert not (tmp_path / "cache").exists()  # refused before reading the corpus or building anything
    small = train_tokenizer(CORPUS, tmp_path / "small", 360)
    with pytest.raises(DataError, match=r"megatron\.bin holds token id 3\d\d \(document \d+, token \d+ of the file\) but the tokenizer has 360 "
                                        r"ids \(0\.\.359\)"):
        prepare_files(DataConfig(blend=f"0.5 {data.low} 0.5 {data.megatron} 1 {data.high}",
                                 tokenizer_model=str(small)), VOCAB)
    train, _, _ = open_run(data, tmp_path, 100, blend=data.megatron)
    narrow = TokenBlocks(train.dataset, train.prefixes, 300, "training")  # past check_token_ids' scan
    with pytest.raises(DataError, match=r"token id 3\d\d in .*megatron\.bin \(training sample \d+\) is outside "
                                        r"the tokenizer's 300 ids"):
        [narrow.sample(i) for i in range(len(narrow))]
    with pytest.raises(IndexError, match=rf"training sample {len(train)} is beyond the {len(train)} samples built"):
        train.sample(len(train))


@pytest.mark.parametrize("overrides, message", [
    (["data.blend='0.3 a 0.x b'"], r"data.blend = '0.3 a 0.x b' does not parse: weight 2 is '0.x', not a number"),
    (["data.blend='0.3 a 0.7'"], r"data.blend = '0.3 a 0.7' does not parse: 3 words mix weights and prefixes"),
    (["data.blend='1 a -2 b'"], r"data.blend = '1 a -2 b': weight 2 is -2; weights must be finite and > 0"),
    (["data.blend='0.3 a 0.7 5'"], r"prefix 2 is the number '5'"),
    (["data.train_blend='a'", "data.tokenizer_model='t.model'"],
     r"train.eval_interval = 20 needs data.valid_blend with data.train_blend"),
    (["data.blend='a'", "data.train_blend='b'", "data.tokenizer_model='t.model'"],
     r"data.blend and data.train_blend / data.valid_blend are exclusive"),
    (["data.blend='a'"], r"data.blend / data.train_blend need data.tokenizer_model"),
    (["data.split='90;10'"], r"data.split = '90;10' does not parse; expected 1 to 3 comma-separated shares"),
    (["data.split='0,1'"], r"data.split = '0,1' gives the training split no share"),
    (["data.split='100,0,0'"], r"data.split = '100,0,0' leaves no validation documents but train.eval_interval"),
    (["data.num_workers=-1"], r"data.num_workers = -1 must be >= 0"),
])
def test_data_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
    assert load_config(None, ["data.split='100,0,0'", "train.eval_interval=0"]).data.split == "100,0,0"


def test_data_files_list_each_prefix_once():
    files = DataFiles("t.model", None, [(["a", "b"], [1.0, 2.0]), (["b"], None), None])
    assert files.prefixes() == ["a", "b"]
