"""Reads text corpora: JSONL (gzip or zstd compressed too), Parquet and Arrow IPC, from files and globs, with
errors naming the file and line (row). Parquet and Arrow files stream in record batches with pyarrow: a corpus
larger than memory reads in pieces of about a row group (Parquet) or a record batch (Arrow, memory-mapped)."""
import glob
import gzip
import io
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional, Sequence

import zstandard

from pretrain.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".jsonl.zstd")
COLUMNAR_SUFFIXES = (".parquet", ".arrow", ".feather")
SUFFIXES = JSONL_SUFFIXES + COLUMNAR_SUFFIXES
CHUNK_BYTES = 1 << 20  # lines handed to a tokenizing worker at a time


def expand_inputs(patterns: Sequence[str | os.PathLike]) -> list[Path]:
    """Each pattern is a file or a glob; returns the files in pattern order, each glob's matches sorted."""
    files: list[Path] = []
    for pattern in patterns:
        pattern = str(pattern)
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise DataError(f"corpus pattern {pattern!r} matches no file")
        for match in matches:
            path = Path(match)
            if not path.is_file():
                raise DataError(f"corpus {match!r} does not exist")
            if not path.name.endswith(SUFFIXES):
                raise DataError(f"corpus {match!r} is not JSONL, Parquet or Arrow: expected one of "
                                f"{', '.join(SUFFIXES)} (JSONL: {{\"text\": ...}} a line; .gz and .zst compressed)")
            if path not in files:
                files.append(path)
    return files


class ZstdReader(io.RawIOBase):
    """The decompressed bytes of a zstd file of one or more frames; a file cut inside a frame raises EOFError
    (zstandard's stream_reader would end quietly there)."""

    def __init__(self, raw: BinaryIO):
        self.raw, self.pending, self.offset = raw, b"", 0
        self.frame, self.in_frame = zstandard.ZstdDecompressor().decompressobj(), False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.offset == len(self.pending):
            data = self.raw.read(CHUNK_BYTES)
            if not data:
                if self.in_frame:
                    raise EOFError("the file ends inside a zstd frame (truncated?)")
                return 0
            self.pending, self.offset = self._decompress(data), 0
        count = min(len(buffer), len(self.pending) - self.offset)
        buffer[:count] = self.pending[self.offset:self.offset + count]
        self.offset += count
        return count

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            self.in_frame = True
            out.append(self.frame.decompress(data))
            data = b""
            if self.frame.eof:  # a frame ended: the rest of the input starts the next one
                data, self.in_frame = self.frame.unused_data, False
                self.frame = zstandard.ZstdDecompressor().decompressobj()
        return b"".join(out)


@contextmanager
def open_lines(path: Path) -> Iterator[tuple[BinaryIO, Callable[[], int]]]:
    """The decompressed byte lines of a corpus file, and a function giving the on-disk bytes read so far."""
    with open(path, "rb") as raw:
        if path.name.endswith(".gz"):
            stream: BinaryIO = gzip.GzipFile(fileobj=raw)
        elif path.name.endswith((".zst", ".zstd")):
            stream = io.BufferedReader(ZstdReader(raw), CHUNK_BYTES)
        else:
            stream = raw
        try:
            yield stream, raw.tell
        except (OSError, EOFError, zstandard.ZstdError) as err:  # gzip.BadGzipFile is an OSError
            raise DataError(f"corpus {str(path)!r} cannot be decompressed: {err}") from None


def document_text(path: str, number: int, line: bytes, key: str) -> Optional[str]:
    """The `key` text of one JSONL line; None for a blank line. Raises DataError naming path:number."""
    if not line.strip():
        return None
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}:{number}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{number}: invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}:{number}: expected a JSON object with a string {key!r} field, "
                        f"got a JSON {type(record).__name__}")
    if not isinstance(record.get(key), str):
        found = ("keys: " + ", ".join(map(repr, list(record)[:8])) if key not in record
                 else f"{key!r} is a {type(record[key]).__name__}")
        raise DataError(f"{path}:{number}: no string {key!r} field ({found}); choose the field with "
                        "--text-column (data.text_column)")
    return record[key]


def column_text(path: str, row: int, value: Optional[bytes], column: str) -> str:
    """One Parquet/Arrow row's text. Raises DataError naming path, row and column."""
    if value is None:
        raise DataError(f"{path}: row {row} (0-based) has no text: column {column!r} is null there")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: row {row} (0-based) of column {column!r}: not UTF-8 text ({err.reason} at "
                        f"byte {err.start})") from None


@dataclass
class Chunk:
    """Consecutive lines of one file, for one worker: their numbers start at first_line.

    columnar: the lines are a Parquet/Arrow column's values (UTF-8 bytes, None for null), numbered by
    row from 0."""
    path: str
    first_line: int
    lines: list[Optional[bytes]]
    bytes_done: int  # on-disk bytes of all inputs read once this chunk is done (for progress)
    columnar: bool = False


def read_chunks(files: Sequence[Path], chunk_bytes: int = CHUNK_BYTES, column: str = "text") -> Iterator[Chunk]:
    """The lines (or `column`'s values) of every file in order, grouped into chunks of about chunk_bytes."""
    done_before = 0
    for path in files:
        if path.name.endswith(COLUMNAR_SUFFIXES):
            for first, values, fraction in read_column_chunks(path, column, chunk_bytes):
                yield Chunk(str(path), first, values, done_before + int(fraction * path.stat().st_size), True)
            done_before += path.stat().st_size
            continue
        with open_lines(path) as (lines, position):
            chunk, size, first = [], 0, 1
            for number, line in enumerate(lines, start=1):
                chunk.append(line)
                size += len(line)
                if size >= chunk_bytes:
                    yield Chunk(str(path), first, chunk, done_before + position())
                    chunk, size, first = [], 0, number + 1
            if chunk:
                yield Chunk(str(path), first, chunk, done_before + position())
        done_before += path.stat().st_size


def chunk_documents(chunk: Chunk, key: str) -> tuple[list[str], int]:
    """The non-empty documents of a chunk, and how many empty ones (whitespace-only text) it skipped."""
    documents, empty = [], 0
    read = column_text if chunk.columnar else document_text
    for number, line in enumerate(chunk.lines, start=chunk.first_line):
        text = read(chunk.path, number, line, key)
        if text is None:
            continue
        if text.strip():
            documents.append(text)
        else:
            empty += 1
    return documents, empty


def read_documents(patterns: str | os.PathLike | Sequence[str | os.PathLike], key: str = "text") -> Iterator[str]:
    """The non-empty documents of JSONL files or globs, in order; raises if there is none."""
    files = expand_inputs([patterns] if isinstance(patterns, (str, os.PathLike)) else patterns)
    found = False
    for chunk in read_chunks(files, column=key):
        documents, _ = chunk_documents(chunk, key)
        found = found or bool(documents)
        yield from documents
    if not found:
        raise DataError(f"corpus {', '.join(map(str, files))} has no non-empty document")


# ---- Parquet and Arrow IPC, streamed with pyarrow
BATCH_ROWS = 1024  # rows pyarrow decodes at a time
_TEXT_TYPES = ("string", "large_string", "string_view", "binary", "large_binary", "binary_view")


def _batches(path: Path, column: str) -> Iterator[tuple["object", int, int]]:
    """(record batch of `column`, rows before it, rows in the file), in file order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    if path.name.endswith(".parquet"):
        parquet = pq.ParquetFile(path)
        _check_column(path, parquet.schema_arrow, column)
        total, done = parquet.metadata.num_rows, 0
        for group in range(parquet.num_row_groups):  # one at a time: over all, pyarrow reads far ahead
            batches = parquet.iter_batches(BATCH_ROWS, row_groups=[group], columns=[column], use_threads=False)
            for batch in batches:
                yield batch, done, total
                done += batch.num_rows
        return
    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        total = sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))  # metadata only
    except pa.ArrowInvalid:  # not the file format: the stream format (Hugging Face datasets' .arrow)
        source.seek(0)
        reader = pa.ipc.open_stream(source)
        batches, total = iter(reader), 0
    _check_column(path, reader.schema, column)
    done = 0
    for batch in batches:
        yield batch.select([column]), done, max(total, done + batch.num_rows)
        done += batch.num_rows


def _check_column(path: Path, schema, column: str) -> None:
    if column not in schema.names:
        raise DataError(f"corpus {str(path)!r} has no column {column!r}; its columns: {', '.join(schema.names)} "
                        "(choose one with --text-column, or data.text_column)")
    kind = str(schema.field(column).type)
    if kind not in _TEXT_TYPES:
        raise DataError(f"column {column!r} of corpus {str(path)!r} holds {kind}, not text (string or binary)")


def read_column_chunks(path: Path, column: str, chunk_bytes: int) -> Iterator[tuple[int, list[Optional[bytes]], float]]:
    """(first row, the column's values as UTF-8 bytes or None, fraction of the file read) per chunk of
    about chunk_bytes of text. Raises DataError naming the file when pyarrow cannot read it."""
    import pyarrow as pa
    first, values, size = 0, [], 0
    try:
        for batch, done, total in _batches(path, column):
            for value in batch.column(0).cast(pa.large_binary()).to_pylist():
                values.append(value)
                size += len(value) if value is not None else 0
                if size >= chunk_bytes:
                    yield first, values, (done + batch.num_rows) / max(total, 1)
                    first, values, size = first + len(values), [], 0
    except (pa.ArrowException, OSError) as err:
        kind = "Parquet" if path.name.endswith(".parquet") else "Arrow IPC"
        raise DataError(f"corpus {str(path)!r} cannot be read as {kind}: {str(err).splitlines()[0]}") from None
    if values:
        yield first, values, 1.0
