"""Parquet and Arrow IPC corpora, streamed in record batches with pyarrow: a corpus larger than memory reads
in pieces of about a row group (Parquet) or a record batch (Arrow, memory-mapped) at a time."""
from pathlib import Path
from typing import Iterator, Optional

from pretrain.data.corpus import DataError

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
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=[column],
                                              use_threads=False):
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
                        "(choose one with --text-column)")
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
        raise DataError(f"corpus {str(path)!r} cannot be read as {'Parquet' if path.name.endswith('.parquet') else 'Arrow IPC'}: "
                        f"{str(err).splitlines()[0]}") from None
    if values:
        yield first, values, 1.0
