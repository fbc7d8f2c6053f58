"""Tokenizes JSONL corpora into Megatron .bin/.idx with N worker processes, showing progress.

    python -m pretrain.preprocess --input 'data/owt/*.jsonl.zst' --tokenizer-model tok.model \\
        --output-prefix out/owt --workers 16
    python -m pretrain.preprocess --input data/corpus.jsonl --tokenizer-model tok.model --output-prefix out/c \\
        --train-tokenizer --vocab-size 512

Workers parse and tokenize chunks of lines; the main process reads the files and writes the tokens in
input order, so the output does not depend on the number of workers.
"""
import argparse
import multiprocessing
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import chain
from typing import Iterable, Iterator, Optional, Sequence

import numpy
from tqdm import tqdm

from pretrain.data.corpus import CHUNK_BYTES, Chunk, DataError, chunk_documents, expand_inputs, read_chunks
from pretrain.data.indexed import IndexedWriter, check_indexed_dataset, token_dtype
from pretrain.data.tokenizer import MAX_SENTENCES, Tokenizer, TokenizerError, train_tokenizer

LOG_INTERVAL_S = 30.0


@dataclass
class TokenizedChunk:
    """One chunk's documents as token ids (each ending in the end-of-document id)."""
    lengths: numpy.ndarray  # tokens per document
    tokens: numpy.ndarray  # all documents, concatenated
    empty: int  # documents skipped for whitespace-only text
    bytes_done: int


@dataclass
class PreprocessStats:
    files: int = 0
    documents: int = 0
    empty: int = 0
    tokens: int = 0
    input_bytes: int = 0
    seconds: float = 0.0
    dtype: str = field(default="")


_worker: dict = {}  # per worker process: the loaded tokenizer and the JSON key


def _init_worker(tokenizer_model: str, key: str) -> None:
    _worker.update(tokenizer=Tokenizer(tokenizer_model), key=key)


def tokenize_chunk(chunk: Chunk) -> TokenizedChunk:
    """Parse, tokenize and pack one chunk (runs in a worker; uses that worker's tokenizer)."""
    tokenizer: Tokenizer = _worker["tokenizer"]
    documents, empty = chunk_documents(chunk, _worker["key"])
    ids = tokenizer.encode_batch(documents)
    for document in ids:
        document.append(tokenizer.eod_id)
    lengths = numpy.fromiter(map(len, ids), dtype=numpy.int64, count=len(ids))
    tokens = numpy.fromiter(chain.from_iterable(ids), dtype=token_dtype(tokenizer.vocab_size),
                            count=int(lengths.sum()))
    return TokenizedChunk(lengths, tokens, empty, chunk.bytes_done)


def tokenized_chunks(chunks: Iterable[Chunk], tokenizer_model: str, key: str,
                     workers: int) -> Iterator[TokenizedChunk]:
    """tokenize_chunk over the chunks, results in input order; `workers` processes (1: this one).

    At most 2 × workers chunks are in flight (Pool.imap would read the whole corpus ahead into its
    task queue); leaving the generator early terminates the pool.
    """
    if workers == 1:
        _init_worker(tokenizer_model, key)
        yield from map(tokenize_chunk, chunks)
        return
    with multiprocessing.Pool(workers, initializer=_init_worker, initargs=(tokenizer_model, key)) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(tokenize_chunk, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class Progress:
    """Documents, tokens, MB/s and ETA: a tqdm bar when stderr is a terminal, else a log line every interval."""

    def __init__(self, total_bytes: int, mode: str = "auto", log_interval_s: float = LOG_INTERVAL_S):
        self.total, self.mode, self.interval = total_bytes, mode, log_interval_s
        if mode == "auto":
            self.mode = "bar" if sys.stderr.isatty() else "log"
        self.start = self.last_log = time.monotonic()
        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess",
                        file=sys.stderr) if self.mode == "bar" else None

    def update(self, stats: PreprocessStats) -> None:
        if self.bar is not None:
            self.bar.update(stats.input_bytes - self.bar.n)
            self.bar.set_postfix_str(f"{stats.documents:,} docs, {stats.tokens:,} tokens", refresh=False)
        elif self.mode == "log" and time.monotonic() - self.last_log >= self.interval:
            self.last_log = time.monotonic()
            print(self.line(stats), file=sys.stderr, flush=True)

    def line(self, stats: PreprocessStats) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = stats.input_bytes / elapsed
        eta = (self.total - stats.input_bytes) / rate if rate > 0 else float("inf")
        return (f"preprocess: {stats.input_bytes / 1e6:,.1f}/{self.total / 1e6:,.1f} MB "
                f"({100 * stats.input_bytes / max(self.total, 1):.0f}%), {stats.documents:,} documents, "
                f"{stats.tokens:,} tokens, {rate / 1e6:.2f} MB/s, ETA {eta:,.0f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def tokenize_corpus(inputs: Sequence[str | os.PathLike], tokenizer_model: str | os.PathLike,
                    output_prefix: str | os.PathLike, workers: int = 1, key: str = "text",
                    progress: str = "off", log_interval_s: float = LOG_INTERVAL_S,
                    chunk_bytes: int = CHUNK_BYTES) -> PreprocessStats:
    """Tokenize every document of the inputs (files or globs) into <output_prefix>.bin/.idx.

    progress: "auto" (bar on a terminal, else log lines), "bar", "log" or "off".
    """
    if workers < 1:
        raise DataError(f"workers {workers} must be at least 1")
    files = expand_inputs(inputs)
    tokenizer = Tokenizer(tokenizer_model)
    stats = PreprocessStats(files=len(files), dtype=token_dtype(tokenizer.vocab_size).__name__)
    start = time.perf_counter()
    meter = Progress(sum(f.stat().st_size for f in files), progress, log_interval_s)
    try:
        with IndexedWriter(output_prefix, tokenizer.vocab_size) as writer:
            for result in tokenized_chunks(read_chunks(files, chunk_bytes), str(tokenizer_model), key, workers):
                ends = numpy.cumsum(result.lengths)
                for begin, end in zip(ends - result.lengths, ends):
                    writer.add_document(result.tokens[begin:end])
                stats.documents += len(result.lengths)
                stats.empty += result.empty
                stats.tokens += int(result.tokens.size)
                stats.input_bytes = result.bytes_done
                meter.update(stats)
            if stats.documents == 0:
                raise DataError(f"corpus {', '.join(map(str, files))} has no non-empty document "
                                f"({stats.empty} empty)")
            writer.finish()
    finally:
        meter.close()
    stats.seconds = time.perf_counter() - start
    return stats


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pretrain.preprocess", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, nargs="+",
                        help="JSONL files or globs ({\"text\": ...} a line; .jsonl.gz and .jsonl.zst too)")
    parser.add_argument("--tokenizer-model", required=True,
                        help="sentencepiece .model to use, or to write with --train-tokenizer")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    parser.add_argument("--json-key", default="text", help="the field holding each document's text")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenizing processes (default: all cores)")
    parser.add_argument("--train-tokenizer", action="store_true",
                        help="train a BPE tokenizer on --input first, saved as --tokenizer-model")
    parser.add_argument("--vocab-size", type=int, help="vocabulary of the trained tokenizer")
    parser.add_argument("--tokenizer-sentences", type=int, default=MAX_SENTENCES,
                        help="lines the tokenizer trains on, sampled from the corpus (default %(default)s)")
    parser.add_argument("--log-interval", type=float, default=LOG_INTERVAL_S,
                        help="seconds between progress lines when stderr is not a terminal")
    args = parser.parse_args(argv)
    if args.train_tokenizer and args.vocab_size is None:
        parser.error("--train-tokenizer needs --vocab-size")
    if args.vocab_size is not None and not args.train_tokenizer:
        parser.error("--vocab-size only applies with --train-tokenizer")
    if args.train_tokenizer and not args.tokenizer_model.endswith(".model"):
        parser.error(f"--tokenizer-model {args.tokenizer_model!r} must end in .model")
    if args.workers < 1:
        parser.error(f"--workers {args.workers} must be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        if args.train_tokenizer:
            train_tokenizer(args.input, args.tokenizer_model[: -len(".model")], args.vocab_size,
                            args.tokenizer_sentences, args.json_key)
            print(f"trained tokenizer {args.tokenizer_model} (vocab_size {args.vocab_size})")
        stats = tokenize_corpus(args.input, args.tokenizer_model, args.output_prefix, args.workers,
                                args.json_key, "auto", args.log_interval)
        check_indexed_dataset(args.output_prefix)
    except (DataError, TokenizerError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.output_prefix}.bin and {args.output_prefix}.idx from {stats.files} file(s): "
          f"{stats.documents} documents ({stats.empty} empty skipped), {stats.tokens} tokens ({stats.dtype}), "
          f"{stats.input_bytes / 1e6:.1f} MB in {stats.seconds:.1f} s ({stats.tokens / stats.seconds:,.0f} tokens/s)")
    return 0

