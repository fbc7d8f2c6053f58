"""Megatron .bin/.idx files: written atomically with megatron-core's builder, checked before they are mapped.

Storage is megatron-core's own IndexedDatasetBuilder/IndexedDataset (MMIDIDX format), so files made
here are readable by Megatron and files made by Megatron-LM's preprocess_data are readable here.
"""
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy
import torch
import megatron_patches.lean  # noqa: F401  (megatron-core without its unused torch.compile/wandb set-up)
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from pretrain.atomic import publish, temporary_name, write_atomically
from pretrain.errors import DataError

# The .idx layout of megatron-core's _IndexWriter: magic, <Q version (1), <B dtype code, <Q sequence
# count, <Q document count, then int32 lengths and int64 pointers per sequence, int64 document indices.
_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")
TOKEN_CHECK_LIMIT = 1 << 24  # tokens of each .bin scanned for ids outside the vocabulary before training
SCAN_TOKENS = 1 << 22  # tokens compared at a time (bounded memory)


def token_dtype(vocab_size: int) -> type:
    """uint16 below 65500 tokens, else int32: megatron's choice, as in Megatron-LM's preprocess_data."""
    return DType.optimal_dtype(vocab_size)


class IndexedWriter:
    """megatron-core's IndexedDatasetBuilder writing under temporary names; finish() renames them into place.

    An interrupted run leaves no <prefix>.bin/.idx pair: the index is written last and both files take
    their real names only once complete (their temporary names, pretrain/atomic.py's, are removed on any error).
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int):
        self.prefix = str(prefix)
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self.dtype = token_dtype(vocab_size)
        self._tmp = {ext: temporary_name(f"{self.prefix}.{ext}") for ext in ("bin", "idx")}
        self._builder = IndexedDatasetBuilder(str(self._tmp["bin"]), dtype=self.dtype)
        self.documents = 0

    def add_document(self, tokens: numpy.ndarray) -> None:
        """One document (its end-of-document id included) as one sequence, as preprocess_data does."""
        self._builder.add_document(torch.from_numpy(tokens), [tokens.size])
        self.documents += 1

    def finish(self) -> str:
        self._builder.finalize(str(self._tmp["idx"]))
        publish(self._tmp["bin"], f"{self.prefix}.bin")
        publish(self._tmp["idx"], f"{self.prefix}.idx")
        return self.prefix

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, *exc) -> None:
        self._builder.data_file.close()
        for leftover in self._tmp.values():
            leftover.unlink(missing_ok=True)


@dataclass(frozen=True)
class IndexSummary:
    """What a checked .idx says about its .bin."""
    bin_path: str
    dtype: type
    sequence_lengths: numpy.ndarray  # tokens per sequence (one sequence per document here)
    document_indices: numpy.ndarray  # sequence index where each document starts, then the count

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=numpy.int64))


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
    if bin_size < expected_bin:
        raise DataError(f"{bin_path} is shorter than its index says: {idx_path} describes {int(starts[-1])} "
                        f"tokens of {dtype.__name__} ({expected_bin} bytes), but the file has {bin_size} "
                        "bytes (truncated copy or interrupted write?)")
    if bin_size > expected_bin:
        raise DataError(f"{bin_path} is longer than its index says: {idx_path} describes {int(starts[-1])} "
                        f"tokens of {dtype.__name__} ({expected_bin} bytes), but the file has {bin_size} "
                        "bytes (the .idx belongs to another .bin?)")
    return IndexSummary(bin_path, dtype, lengths, documents)


def check_dtype(index: IndexSummary, vocab_size: int) -> None:
    """Refuse a .bin whose dtype cannot be a tokenizer's of this vocabulary: floats are no token ids, and an
    integer type too narrow for ids up to vocab_size - 1 (uint16 with 65536 ids or more) means the
    .bin/.idx was made with another, smaller tokenizer."""
    if not numpy.issubdtype(index.dtype, numpy.integer):
        raise DataError(f"{index.bin_path} stores {index.dtype.__name__} values, not integer token ids; "
                        "write it with python -m pretrain.preprocess or Megatron-LM's preprocess_data")
    largest = numpy.iinfo(index.dtype).max
    if largest < vocab_size - 1:
        raise DataError(f"{index.bin_path} stores {index.dtype.__name__} token ids (at most {largest}) but the "
                        f"vocabulary has {vocab_size} ids (0..{vocab_size - 1}): it was made with another, smaller "
                        "tokenizer; name that tokenizer (or its vocabulary: model.vocab_size) or re-run "
                        "python -m pretrain.preprocess")


def check_token_ids(prefix: str | os.PathLike, vocab_size: int, limit: Optional[int] = TOKEN_CHECK_LIMIT) -> None:
    """Refuse a .bin whose dtype does not fit the vocabulary (check_dtype) or that holds a token id
    outside 0..vocab_size-1, scanning its first `limit` tokens (None: all), naming the document.

    A .bin made with a larger tokenizer is caught here, before training; a bad id past the limit is
    caught when its sample is read (pretrain.data.datasets.TokenBlocks).
    """
    index = check_indexed_dataset(prefix)
    check_dtype(index, vocab_size)
    count = index.num_tokens if limit is None else min(limit, index.num_tokens)
    if count == 0:
        return
    tokens = numpy.memmap(index.bin_path, dtype=index.dtype, mode="r", shape=(count,))
    for start in range(0, count, SCAN_TOKENS):
        window = tokens[start:start + SCAN_TOKENS]
        if int(window.max()) < vocab_size and int(window.min()) >= 0:
            continue
        position = start + int(numpy.argmax((window >= vocab_size) | (window < 0)))
        sequence = int(numpy.searchsorted(numpy.cumsum(index.sequence_lengths, dtype=numpy.int64), position,
                                          side="right"))
        document = int(numpy.searchsorted(index.document_indices, sequence, side="right")) - 1
        raise DataError(f"{index.bin_path} holds token id {int(tokens[position])} (document {document}, token "
                        f"{position} of the file) but the tokenizer has {vocab_size} ids (0..{vocab_size - 1}): "
                        "the .bin/.idx was made with another, larger tokenizer; use that tokenizer "
                        "(data.tokenizer_model, or model.vocab_size with data.tokenizer_kind = 'none') or re-run "
                        "python -m pretrain.preprocess")


# ---- <prefix>.tokenizer.json: which tokenizer made a .bin/.idx pair (written by pretrain.preprocess)
TOKENIZER_RECORD = ".tokenizer.json"


def tokenizer_record_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}{TOKENIZER_RECORD}")


def _file_sizes(prefix: str | os.PathLike) -> dict:
    return {"bin_bytes": os.path.getsize(f"{prefix}.bin"), "idx_bytes": os.path.getsize(f"{prefix}.idx")}


def write_tokenizer_record(prefix: str | os.PathLike, tokenizer) -> Path:
    """Beside a just-written <prefix>.bin/.idx, atomically: the tokenizer that made it (kind, vocabulary,
    end-of-document id, `files_sha256`: its kind, settings and every file's bytes) and the two files' sizes, which
    tie the record to these files (a rewrite without a new record is found out)."""
    record = {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "eod_id": tokenizer.eod_id,
              "files_sha256": tokenizer.files_sha256(), "files": [Path(f).name for f in tokenizer.files],
              **_file_sizes(prefix)}
    return write_atomically(tokenizer_record_path(prefix), json.dumps(record, indent=1, sort_keys=True) + "\n")


def check_tokenizer_record(prefix: str | os.PathLike, tokenizer, key: str) -> Optional[str]:
    """A blend prefix's .bin/.idx against the run's tokenizer: DataError (one line) when its record names another
    tokenizer, or describes other files; a note (str) when it has no record (made elsewhere: not checked)."""
    path = tokenizer_record_path(prefix)
    if not path.is_file():
        return (f"note: data.{key} prefix {prefix} has no {path.name} (the record python -m pretrain.preprocess writes of "
                "the tokenizer that made it): its tokenizer is not checked")
    try:
        record = json.loads(path.read_text())
        saved, sizes = record["files_sha256"], {k: record[k] for k in ("bin_bytes", "idx_bytes")}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path} is not a tokenizer record ({type(err).__name__}: {err})", f"data.{key}",
                        "re-run python -m pretrain.preprocess for this prefix, or remove the record") from None
    if sizes != _file_sizes(prefix):
        raise DataError(f"{path} does not describe {prefix}.bin/.idx: it records {sizes['bin_bytes']} / "
                        f"{sizes['idx_bytes']} bytes, the files have {_file_sizes(prefix)['bin_bytes']} / "
                        f"{_file_sizes(prefix)['idx_bytes']} (rewritten without their record)", f"data.{key}",
                        "re-run python -m pretrain.preprocess for this prefix, or remove the stale record")
    if tokenizer.kind == "none":  # ids made elsewhere: no tokenizer of this run to compare with
        return None
    now = tokenizer.files_sha256()
    if saved != now:
        made = f"{record.get('kind')} {', '.join(record.get('files') or [])} of {record.get('vocab_size')} ids"
        ours = f"{tokenizer.kind} {', '.join(str(f) for f in tokenizer.files)} of {tokenizer.vocab_size} ids"
        raise DataError(f"{prefix}.bin was tokenized by another tokenizer than this run's: {path.name} records {made} "
                        f"(sha256 {saved[:12]}), the run's is {ours} (sha256 {now[:12]})", f"data.{key}",
                        "name the tokenizer that made it (data.tokenizer_model), or tokenize the corpus again with "
                        "this one (python -m pretrain.preprocess)")
    return None
