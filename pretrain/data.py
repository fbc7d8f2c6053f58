"""Turns a text corpus into Megatron .bin/.idx files and GPT train/validation samples, with clear errors.

Storage is megatron-core's own IndexedDatasetBuilder/IndexedDataset (MMIDIDX format), so files made
here are readable by Megatron and files made by Megatron's preprocess_data are readable here.

GPT samples are cut here rather than by megatron-core's GPTDataset. Its C++ helpers ship compiled in
the wheel and it runs on CPU, but it does not fit this contract: it needs the total number of samples
up front (or builds exactly one epoch), shuffles documents as well as samples, returns dicts of
tokens/labels/masks, and caches its indices either beside the data or under a path_to_cache that it
guards with its own rank-0/barrier protocol. Here a split is a contiguous run of documents, so its
token stream is one contiguous slice of the .bin: sample k is tokens [k*S, k*S + S + 1) of that slice
(S = seq_length; one token overlaps the next sample, as with Megatron's add_extra_token_to_sequence).
"""
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from pretrain.tokenizer import Tokenizer, train_tokenizer

# The .idx layout of megatron-core's _IndexWriter: magic, <Q version (1), <B dtype code, <Q sequence
# count, <Q document count, then int32 lengths and int64 pointers per sequence, int64 document indices.
_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")


class DataError(ValueError):
    """A corpus, token file or split is unusable; the message names the file and what is wrong."""


def read_documents(path: str | os.PathLike) -> Iterator[str]:
    """Yield the non-empty documents of a .jsonl ({"text": ...} a line) or .txt (blank-line separated)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"corpus {str(path)!r} does not exist")
    if path.suffix not in (".jsonl", ".txt"):
        raise DataError(f"corpus {str(path)!r} must be .jsonl ({{\"text\": ...}} per line) or .txt")
    found = False
    with path.open(encoding="utf-8") as lines:
        try:
            for document in (_jsonl_documents if path.suffix == ".jsonl" else _txt_documents)(path, lines):
                if document.strip():
                    found = True
                    yield document
        except UnicodeDecodeError as err:
            raise DataError(f"corpus {str(path)!r} is not UTF-8 text: {err}") from None
    if not found:
        raise DataError(f"corpus {str(path)!r} has no non-empty document")


def _jsonl_documents(path: Path, lines: Iterable[str]) -> Iterator[str]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: invalid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{path}:{number}: expected an object with a string "text" field')
        yield record["text"]


def _txt_documents(path: Path, lines: Iterable[str]) -> Iterator[str]:
    document: list[str] = []
    for line in lines:
        if line.strip():
            document.append(line)
        elif document:
            yield "".join(document).rstrip("\n")
            document = []
    if document:
        yield "".join(document).rstrip("\n")


def write_indexed_dataset(documents_token_ids: Iterable[Sequence[int]], output_prefix: str | os.PathLike,
                          vocab_size: int, eod_id: int) -> str:
    """Write <prefix>.bin/.idx with megatron-core's builder, one sequence per document ending in eod_id."""
    prefix = str(output_prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    dtype = DType.optimal_dtype(vocab_size)  # uint16 below 65500 tokens, else int32, as preprocess_data
    tmp = f"{prefix}.tmp{os.getpid()}"
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
    try:
        for number, ids in enumerate(documents_token_ids):
            tokens = numpy.append(numpy.asarray(ids, dtype=numpy.int64), eod_id)
            if tokens.min() < 0 or tokens.max() >= vocab_size:
                raise DataError(f"document {number} has a token id outside 0..{vocab_size - 1}: "
                                f"{int(tokens.min())}..{int(tokens.max())}")
            builder.add_document(torch.from_numpy(tokens), [tokens.size])
        builder.finalize(f"{tmp}.idx")
        # Both files are complete before either takes the real name; a crash between the two renames
        # leaves a mismatched pair, which check_indexed_dataset rejects and prepare_files rebuilds.
        os.replace(f"{tmp}.bin", f"{prefix}.bin")
        os.replace(f"{tmp}.idx", f"{prefix}.idx")
    finally:
        builder.data_file.close()
        for leftover in (f"{tmp}.bin", f"{tmp}.idx"):
            if os.path.exists(leftover):
                os.remove(leftover)
    return prefix


def preprocess(corpus_path: str | os.PathLike, tokenizer: Tokenizer, output_prefix: str | os.PathLike) -> str:
    """Tokenize every document of the corpus into <output_prefix>.bin/.idx; returns the prefix."""
    token_ids = (tokenizer.encode(text) for text in read_documents(corpus_path))
    return write_indexed_dataset(token_ids, output_prefix, tokenizer.vocab_size, tokenizer.eod_id)


@dataclass(frozen=True)
class IndexSummary:
    """What a checked .idx says about its .bin."""
    bin_path: str
    dtype: type
    sequence_lengths: numpy.ndarray  # tokens per sequence (here, per document)
    document_indices: numpy.ndarray  # sequence index where each document starts, then the count


def check_indexed_dataset(prefix: str | os.PathLike) -> IndexSummary:
    """Validate <prefix>.idx/.bin against Megatron's MMIDIDX layout before megatron-core maps them."""
    idx_path, bin_path = f"{prefix}.idx", f"{prefix}.bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise DataError(f"indexed dataset {str(prefix)!r} is incomplete: {path} does not exist")
    idx_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as stream:
        header = stream.read(_HEADER.size)
        if len(header) < _HEADER.size:
            raise DataError(f"{idx_path} is truncated: {idx_size} bytes, "
                            f"shorter than the {_HEADER.size}-byte header")
        magic, version, code, sequence_count, document_count = _HEADER.unpack(header)
        if magic != _MAGIC:
            raise DataError(f"{idx_path} is not a Megatron index: header {magic!r} is not {_MAGIC!r}")
        if version != 1:
            raise DataError(f"{idx_path} has index version {version}; only version 1 is readable")
        known_codes = sorted(d.value for d in DType)
        if code not in known_codes:
            raise DataError(f"{idx_path} has unknown dtype code {code}; known codes: {known_codes}")
        expected = _HEADER.size + (4 + 8) * sequence_count + 8 * document_count
        if idx_size != expected:
            raise DataError(f"{idx_path} is truncated or corrupt: its header describes {sequence_count} "
                            f"sequences and {document_count} document indices, which take {expected} bytes, "
                            f"but the file has {idx_size} bytes")
        lengths = numpy.fromfile(stream, dtype=numpy.int32, count=sequence_count)
        pointers = numpy.fromfile(stream, dtype=numpy.int64, count=sequence_count)
        documents = numpy.fromfile(stream, dtype=numpy.int64, count=document_count)
    dtype = DType.dtype_from_code(code)
    itemsize = DType.size(dtype)
    starts = numpy.concatenate(([0], numpy.cumsum(lengths, dtype=numpy.int64)))
    if (lengths < 0).any() or not numpy.array_equal(pointers, starts[:-1] * itemsize):
        raise DataError(f"{idx_path} is corrupt: its sequence pointers do not follow its sequence lengths")
    if (document_count == 0 or documents[0] != 0 or documents[-1] != sequence_count
            or (numpy.diff(documents) < 0).any()):
        raise DataError(f"{idx_path} is corrupt: its document indices do not run from 0 to {sequence_count}")
    expected_bin = int(starts[-1]) * itemsize
    bin_size = os.path.getsize(bin_path)
    if bin_size != expected_bin:
        raise DataError(f"{bin_path} is truncated or corrupt: {idx_path} describes {int(starts[-1])} "
                        f"tokens of {dtype.__name__}, expected {expected_bin} bytes, but the file has "
                        f"{bin_size} bytes")
    return IndexSummary(bin_path, dtype, lengths, documents)


def load_indexed_dataset(prefix: str | os.PathLike) -> IndexedDataset:
    """megatron-core's IndexedDataset over <prefix>.bin/.idx, after check_indexed_dataset."""
    check_indexed_dataset(prefix)
    return IndexedDataset(str(prefix))


class GPTSamples(torch.utils.data.Dataset):
    """Samples of seq_length+1 tokens cut from one split's token stream; shuffled per epoch when seeded."""

    def __init__(self, bin_path: str, dtype: type, token_start: int, token_count: int, seq_length: int,
                 seed: Optional[int], model_vocab_size: int):
        self.bin_path, self.dtype, self.seq_length, self.seed = bin_path, dtype, seq_length, seed
        self.token_start, self.token_count, self.model_vocab_size = token_start, token_count, model_vocab_size
        self.num_samples = (token_count - 1) // seq_length
        self._tokens: Optional[numpy.ndarray] = None
        self._order: tuple[int, Optional[numpy.ndarray]] = (-1, None)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is out of range for {self.num_samples} samples; "
                             "sample() wraps around epochs")
        return self.sample(index)

    def sample(self, index: int) -> torch.Tensor:
        """Sample `index` of an endless run of epochs; epoch e is shuffled with RandomState(seed + e)."""
        epoch, position = divmod(index, self.num_samples)
        if self.seed is None:
            return self.window(position)
        if self._order[0] != epoch:
            self._order = (epoch, numpy.random.RandomState(self.seed + epoch).permutation(self.num_samples))
        return self.window(int(self._order[1][position]))

    def window(self, k: int) -> torch.Tensor:
        """The k-th sample in token-stream order: tokens [k*S, k*S + S + 1) of the split."""
        if self._tokens is None:  # mapped on first use, so a pickled copy (DataLoader worker) maps its own
            self._tokens = numpy.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.token_count,),
                                        offset=self.token_start * numpy.dtype(self.dtype).itemsize)
        start = k * self.seq_length
        tokens = torch.from_numpy(self._tokens[start:start + self.seq_length + 1].astype(numpy.int64))
        if int(tokens.max()) >= self.model_vocab_size:
            raise DataError(f"token id {int(tokens.max())} in {self.bin_path} is outside model.vocab_size "
                            f"{self.model_vocab_size}; the .bin/.idx was made with a larger tokenizer")
        return tokens

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None, "_order": (-1, None)}


def build_gpt_datasets(prefix: str | os.PathLike, seq_length: int, valid_fraction: float, seed: int,
                       model_vocab_size: int) -> tuple[GPTSamples, GPTSamples]:
    """Split <prefix> by documents (first 1 - valid_fraction train, the rest valid) into GPT sample sets."""
    if not 0 < valid_fraction < 1:
        raise DataError(f"valid_fraction {valid_fraction} must be in (0, 1)")
    if seq_length < 1:
        raise DataError(f"seq_length {seq_length} must be at least 1")
    index = check_indexed_dataset(prefix)
    starts = numpy.concatenate(([0], numpy.cumsum(index.sequence_lengths, dtype=numpy.int64)))
    document_starts = starts[index.document_indices]  # token offset of each document, then the total
    num_documents = len(document_starts) - 1
    num_train = int(round((1 - valid_fraction) * num_documents))
    splits = {}
    bounds = {"training": (0, num_train, seed), "validation": (num_train, num_documents, None)}
    for name, (first, last, split_seed) in bounds.items():
        token_start = int(document_starts[first])
        token_count = int(document_starts[last]) - token_start
        if token_count - 1 < seq_length:
            raise DataError(f"{name} split is empty: {last - first} of {num_documents} documents "
                            f"({token_count} tokens) at valid_fraction {valid_fraction} give no sample of "
                            f"seq_length + 1 = {seq_length + 1} tokens; use a larger corpus, another "
                            "valid_fraction or a smaller seq_length")
        splits[name] = GPTSamples(index.bin_path, index.dtype, token_start, token_count, seq_length,
                                  split_seed, model_vocab_size)
    return splits["training"], splits["validation"]


def _check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    if tokenizer.vocab_size > model_vocab_size:
        raise DataError(f"tokenizer vocabulary {tokenizer.vocab_size} is larger than model.vocab_size "
                        f"{model_vocab_size}; raise model.vocab_size or use a smaller tokenizer "
                        f"({tokenizer.model_path})")


def _digest(*parts: object) -> str:
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


def prepare_files(corpus: str | os.PathLike, tokenizer_model: Optional[str], data_prefix: Optional[str],
                  cache_dir: str | os.PathLike, vocab_size: int) -> tuple[Path, str]:
    """Train the tokenizer and build .bin/.idx into cache_dir where not given; idempotent and atomic.

    Cache names hash the corpus's path, mtime and size (with the vocab size for the tokenizer, the
    tokenizer's bytes for the tokens), so an edited corpus or another tokenizer builds anew.
    cache_dir is relative to the current directory unless absolute.
    """
    if tokenizer_model is not None:
        _check_vocab(Tokenizer(tokenizer_model), vocab_size)  # before any expensive work
    if data_prefix is not None:
        if tokenizer_model is None:
            raise DataError(f"data.prefix {data_prefix!r} needs data.tokenizer_model: the tokenizer that "
                            "made its token ids must be named, not trained anew")
        check_indexed_dataset(data_prefix)
        return Path(tokenizer_model), str(data_prefix)
    corpus = Path(corpus)
    if not corpus.is_file():
        raise DataError(f"corpus {str(corpus)!r} does not exist")
    stat = corpus.stat()
    corpus_key = (corpus.resolve(), stat.st_mtime_ns, stat.st_size)
    if tokenizer_model is not None:
        tokenizer_path = Path(tokenizer_model)
    else:
        tokenizer_path = Path(cache_dir) / f"tokenizer-{_digest(*corpus_key, vocab_size)}.model"
        if not tokenizer_path.is_file():
            train_tokenizer(corpus, tokenizer_path.with_suffix(""), vocab_size)
    tokenizer_hash = hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()
    prefix = str(Path(cache_dir) / f"tokens-{_digest(*corpus_key, tokenizer_hash)}")
    try:
        check_indexed_dataset(prefix)
    except DataError:  # absent, or left inconsistent by an interrupted build: build it (again)
        preprocess(corpus, Tokenizer(tokenizer_path), prefix)
    return tokenizer_path, prefix


def open_datasets(tokenizer_path: str | os.PathLike, prefix: str | os.PathLike, seq_length: int,
                  valid_fraction: float, seed: int,
                  model_vocab_size: int) -> tuple[GPTSamples, GPTSamples, Tokenizer]:
    """Load the tokenizer, check it fits the model, and open the train/valid sample sets of <prefix>."""
    tokenizer = Tokenizer(tokenizer_path)
    _check_vocab(tokenizer, model_vocab_size)
    train, valid = build_gpt_datasets(prefix, seq_length, valid_fraction, seed, model_vocab_size)
    return train, valid, tokenizer


def prepare_data(corpus: str | os.PathLike, tokenizer_model: Optional[str], data_prefix: Optional[str],
                 cache_dir: str | os.PathLike, vocab_size: int, seq_length: int, valid_fraction: float,
                 seed: int) -> tuple[GPTSamples, GPTSamples, Tokenizer]:
    """The training loop's one call: prepare_files (a no-op once rank 0 has run it), then open_datasets."""
    tokenizer_path, prefix = prepare_files(corpus, tokenizer_model, data_prefix, cache_dir, vocab_size)
    return open_datasets(tokenizer_path, prefix, seq_length, valid_fraction, seed, vocab_size)
