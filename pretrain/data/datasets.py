"""GPT train/validation samples through megatron-core: blends, splits, cached indices, seq+1 token blocks.

megatron-core's BlendedMegatronDatasetBuilder builds GPTDatasets (one per prefix and split) and, for
weighted blends, a BlendedDataset over them, with Megatron's rules: documents split by data.split,
shuffled per epoch, samples cut across document boundaries, the sample order shuffled, and as many
epochs as the requested number of samples needs. Its document/sample/shuffle indices are cached in
data.cache_dir (keyed by prefix, seed, seq_length, split and sample count); rank 0 builds them first
and the other ranks load them after a barrier. So a .bin/.idx written by Megatron-LM's preprocess_data
gives here the samples Megatron-LM would train on, for the same seed, sequence length and split.
"""
import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy
import torch
import megatron_patches.lean  # noqa: F401  (megatron-core without its unused torch.compile/wandb set-up)
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset

from pretrain.blend import Blend
from pretrain.sections import DataConfig
from pretrain.data.corpus import expand_inputs, read_documents
from pretrain.data.indexed import check_indexed_dataset, check_token_ids, check_tokenizer_record
from pretrain.data.preprocess import sample_sentences, tokenize_files, train_hf_tokenizer, train_tokenizer
from pretrain.data.tokenizers import (TextTokenizer, TokenizerSpec, check_eod, check_vocab, identity_path,
                                      load_tokenizer, spec_of)
from pretrain.errors import DataError

HF_TRAIN_DOCUMENTS = 200_000  # documents a byte-level BPE trains on, sampled from a bigger corpus

@dataclass(frozen=True)
class DataFiles:
    """What rank 0 prepared and checked, shared with every rank: the tokenizer and the blends to open.

    tokenizer_path is the file whose bytes a checkpoint's identity hashes: the sentencepiece .model, or
    for the other kinds a small JSON in cache_dir holding the kind, its settings and the SHA-256 over
    every file the tokenizer reads (pretrain/data/tokenizers.py: `identity_path`)."""
    tokenizer_path: str
    blend: Optional[Blend]  # split by data.split ...
    blend_per_split: Optional[list[Optional[Blend]]]  # ... or one blend per split (train, valid, test)
    tokenizer: Optional[TokenizerSpec] = None  # None: the sentencepiece model at tokenizer_path
    notes: tuple[str, ...] = ()  # lines for rank 0 to say (a blend prefix whose tokenizer is not recorded)

    def spec(self) -> TokenizerSpec:
        return self.tokenizer or TokenizerSpec("sentencepiece", self.tokenizer_path)

    def load_tokenizer(self) -> TextTokenizer:
        return load_tokenizer(self.spec())

    def tokenizer_record(self) -> dict:
        """What a checkpoint's manifest records of the tokenizer (export --format hf reads it back): its spec, its
        files as absolute paths."""
        spec = self.spec()
        return {"kind": spec.kind, "model": str(Path(spec.model).resolve()) if spec.model else None,
                "merges": str(Path(spec.merges).resolve()) if spec.merges else None, "eod": spec.eod}

    def prefixes(self) -> list[str]:
        blends = [self.blend] if self.blend else [b for b in self.blend_per_split or [] if b]
        return list(dict.fromkeys(prefix for prefixes, _ in blends for prefix in prefixes))


@dataclass(frozen=True)
class DatasetTokenizer:
    """What megatron-core's GPTDataset asks of a tokenizer: sizes and special ids, and a cache identity."""
    vocab_size: int
    eod: int
    pad: int
    unique_identifiers: dict

    @property
    def eos(self) -> int:
        return self.eod


def _digest(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def _single(blend: Blend) -> Blend:
    """One prefix needs no weight: megatron then builds a plain GPTDataset, not a blend of one."""
    prefixes, weights = blend
    return (prefixes, None) if len(prefixes) == 1 else (prefixes, weights)


def _blends(data: DataConfig) -> tuple[Optional[Blend], Optional[list[Optional[Blend]]]]:
    """data.blend, or the per-split blends (train, valid, test), as the section parsed them."""
    blends = {key: _single(blend) for key, blend in data.blends().items()}
    if "blend" in blends:
        return blends["blend"], None
    if "train_blend" in blends:
        return None, [blends["train_blend"], blends.get("valid_blend"), None]
    return None, None


def build_corpus_files(corpus: str, spec: TokenizerSpec | str | None, cache_dir: str | os.PathLike,
                       vocab_size: int, column: str = "text") -> tuple[TokenizerSpec, str]:
    """Train the tokenizer (unless given: sentencepiece or hf) and tokenize the corpus's `column` (data.text_column)
    into cache_dir; idempotent and atomic. `spec` may be a sentencepiece path, or None for a trained sentencepiece model.

    Cache names hash the input files' paths, mtimes and sizes (with the vocab size and kind for the
    tokenizer, the tokenizer's files_sha256 for the tokens, and a text column other than "text"), so an edited
    corpus, another column or another tokenizer builds anew.
    """
    if not isinstance(spec, TokenizerSpec):
        spec = TokenizerSpec("sentencepiece", None if spec is None else str(spec))
    files = expand_inputs([corpus])
    corpus_key = [(f.resolve(), f.stat().st_mtime_ns, f.stat().st_size) for f in files]
    if column != "text":  # the default column keeps the cache names it always had
        corpus_key.append(("column", column))
    if spec.model is None and spec.kind == "sentencepiece":
        tokenizer_path = Path(cache_dir) / f"tokenizer-{_digest(corpus_key, vocab_size)}.model"
        if not tokenizer_path.is_file():
            train_tokenizer(corpus, tokenizer_path.with_suffix(""), vocab_size, key=column)
        spec = TokenizerSpec("sentencepiece", str(tokenizer_path))
    elif spec.model is None and spec.kind == "hf":
        tokenizer_path = Path(cache_dir) / f"tokenizer-{_digest(corpus_key, vocab_size, 'hf', spec.eod)}.json"
        if not tokenizer_path.is_file():
            documents = sample_sentences(read_documents(corpus, column), HF_TRAIN_DOCUMENTS)
            train_hf_tokenizer(documents, tokenizer_path, vocab_size, spec.eod or "<|endoftext|>")
        spec = TokenizerSpec("hf", str(tokenizer_path), eod=spec.eod)
    tokenizer = load_tokenizer(spec)
    prefix = str(Path(cache_dir) / f"tokens-{_digest(corpus_key, tokenizer.files_sha256())}")
    try:
        check_indexed_dataset(prefix)
    except DataError:  # absent, or left inconsistent by an interrupted build: build it (again)
        tokenize_files(files, spec, tokenizer, prefix, key=column)
    return spec, prefix


def prepare_files(data: DataConfig, vocab_size: int) -> DataFiles:
    """Rank 0's part, before any dataset is opened: check the tokenizer against the model, then either
    check every blend prefix's .bin/.idx (and its token ids against the tokenizer) or build the corpus's
    tokenizer and tokens into data.cache_dir (reused once built).
    """
    spec = spec_of(data, vocab_size)
    tokenizer = None if spec.model is None and spec.kind != "none" else load_tokenizer(spec)
    if tokenizer is not None:
        check_vocab(tokenizer, vocab_size)  # before any expensive work
        check_eod(tokenizer, data)
    blend, blend_per_split = _blends(data)
    if blend is None and blend_per_split is None:
        if data.corpus is None:
            raise DataError("no data: data.corpus, data.blend and data.train_blend are all unset")
        spec, prefix = build_corpus_files(data.corpus, spec, data.cache_dir, vocab_size, data.text_column)
        tokenizer = load_tokenizer(spec)
        check_vocab(tokenizer, vocab_size)
        check_eod(tokenizer, data)
        return DataFiles(identity_path(tokenizer, spec, data.cache_dir), ([prefix], None), None, spec)
    files = DataFiles(identity_path(tokenizer, spec, data.cache_dir), blend, blend_per_split, spec)
    notes = []
    for key, (prefixes, _) in data.blends().items():
        for prefix in prefixes:
            notes.append(check_tokenizer_record(prefix, tokenizer, key))
            check_token_ids(prefix, tokenizer.vocab_size)
    return dataclasses.replace(files, notes=tuple(dict.fromkeys(n for n in notes if n)))


class TokenBlocks(torch.utils.data.Dataset):
    """The seq_length+1 tokens each megatron sample is cut from (its tokens, then its last label).

    sample(i) is what the training loop reads: inputs are block[:-1], labels block[1:]; with `fields`
    (DataConfig.document_fields) a dict of the block ("tokens") and megatron's per-sample fields of those
    names (pretrain/data/batch.py)."""

    def __init__(self, dataset, prefixes: list[str], vocab_size: int, split: str, fields: tuple[str, ...] = ()):
        self.dataset, self.prefixes, self.vocab_size, self.split = dataset, prefixes, vocab_size, split
        self.fields = fields

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.sample(index)

    def sample(self, index: int) -> torch.Tensor | dict:
        if not 0 <= index < len(self.dataset):
            raise IndexError(f"{self.split} sample {index} is beyond the {len(self.dataset)} samples built for "
                             f"this run (train.steps × train.global_batch_size for training)")
        item = self.dataset[index]
        block = torch.cat([item["tokens"], item["labels"][-1:]])
        if int(block.max()) >= self.vocab_size:
            prefix = self.prefixes[int(item.get("dataset_id", 0))]
            raise DataError(f"token id {int(block.max())} in {prefix}.bin ({self.split} sample {index}) is outside "
                            f"the tokenizer's {self.vocab_size} ids: the .bin/.idx was made with a larger "
                            "tokenizer")
        if self.fields:
            return {"tokens": block, **{name: item[name] for name in self.fields}}
        return block

    def source(self, index: int) -> str:
        """The prefix sample `index` comes from."""
        return self.prefixes[int(self.dataset[index].get("dataset_id", 0))]


def _split_prefixes(files: DataFiles, index: int) -> list[str]:
    if files.blend is not None:
        return files.blend[0]
    blend = files.blend_per_split[index]
    return blend[0] if blend else []


def _check_split_sizes(config: GPTDatasetConfig, seq_length: int) -> None:
    """Refuse a split with less than one sample of tokens, on every rank before megatron's collectives
    (megatron would loop forever over an empty split, or stop rank 0 while the others wait)."""
    for index, name in enumerate(("training", "validation", "test")):
        if config.blend is not None:
            bounds = config.split_matrix[index]
            prefixes = config.blend[0] if bounds else []
        else:
            blend = config.blend_per_split[index]
            prefixes, bounds = (blend[0], (0.0, 1.0)) if blend else ([], None)
        for prefix in prefixes:
            indexed = IndexedDataset(prefix)  # kept while its memory-mapped lengths are read
            lengths = indexed.sequence_lengths
            # megatron's rule (BlendedMegatronDatasetBuilder._build_megatron_dataset_splits)
            first, last = int(round(bounds[0] * float(len(lengths)))), int(round(bounds[1] * float(len(lengths))))
            tokens = int(lengths[first:last].sum(dtype=numpy.int64))
            if tokens < seq_length + 1:
                split = f"data.split = {config.split!r}" if config.blend is not None else "its per-split blend"
                raise DataError(f"{name} split of {prefix} is too small: documents {first}..{last} of "
                                f"{len(lengths)} ({tokens} tokens) at {split} give no sample of seq_length + 1 = "
                                f"{seq_length + 1} tokens; use more data, another data.split or a smaller "
                                "seq_length")


def dataset_config(files: DataFiles, data: DataConfig, tokenizer: TextTokenizer, seq_length: int, seed: int,
                   sizes: list[int]) -> GPTDatasetConfig:
    """megatron-core's GPTDatasetConfig as Megatron-LM's pretrain_gpt sets it, with data.reset_position_ids,
    reset_attention_mask and eod_mask_loss (the [1, s, s] mask is built only with reset_attention_mask); splits
    that the run reads no sample from (sizes[i] == 0) are not built."""
    identity = {"class": "SentencePieceTokenizer" if tokenizer.kind == "sentencepiece" else tokenizer.kind,
                "vocab_size": tokenizer.vocab_size,
                "data_files": {p: [os.path.getsize(f"{p}.idx"), os.path.getsize(f"{p}.bin")]
                               for p in files.prefixes()}}
    blend_per_split = (None if files.blend_per_split is None
                       else [blend if size else None for blend, size in zip(files.blend_per_split, sizes)])
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=files.blend, blend_per_split=blend_per_split,
        split=data.split if files.blend is not None else None, path_to_cache=str(data.cache_dir),
        tokenizer=DatasetTokenizer(tokenizer.vocab_size, tokenizer.eod_id, -1, identity),
        reset_position_ids=data.reset_position_ids, reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss, create_attention_mask=data.reset_attention_mask)
    if config.split_matrix is not None:  # the split's book-ends stay; unread splits are not built
        config.split_matrix = [bounds if size else None for bounds, size in zip(config.split_matrix, sizes)]
    return config


def open_datasets(files: DataFiles, data: DataConfig, seq_length: int, seed: int, model_vocab_size: int,
                  train_samples: int, valid_samples: int) -> tuple[TokenBlocks, Optional[TokenBlocks], TextTokenizer]:
    """Every rank: megatron-core's train/valid datasets for `files`, as TokenBlocks, and the tokenizer.

    train_samples / valid_samples: how many samples the run reads (megatron builds enough epochs; the
    sample order depends on them only through the number of epochs). Collective when torch.distributed
    is initialised: rank 0 builds the cached indices, the others wait at a barrier, then load them.
    valid is None when valid_samples is 0 or the split gives validation no documents.
    """
    tokenizer = files.load_tokenizer()
    check_vocab(tokenizer, model_vocab_size)
    config = dataset_config(files, data, tokenizer, seq_length, seed, [train_samples, valid_samples, 0])
    _check_split_sizes(config, seq_length)
    train, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [train_samples, valid_samples, 0], lambda: True, config).build()
    fields = data.document_fields()
    return (TokenBlocks(train, _split_prefixes(files, 0), tokenizer.vocab_size, "training", fields),
            None if valid is None else TokenBlocks(valid, _split_prefixes(files, 1), tokenizer.vocab_size,
                                                   "validation", fields),
            tokenizer)
