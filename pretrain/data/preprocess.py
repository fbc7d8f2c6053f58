"""Tokenizes JSONL, Parquet or Arrow corpora into Megatron .bin/.idx with N worker processes, showing progress.

    python -m pretrain.preprocess --input 'data/owt/*.jsonl.zst' --tokenizer-model tok.model \\
        --output-prefix out/owt --workers 16
    python -m pretrain.preprocess --input 'data/fw/*.parquet' --tokenizer-kind gpt2_bpe \\
        --tokenizer-model vocab.json --tokenizer-merges merges.txt --output-prefix out/fw
    python -m pretrain.preprocess --input data/corpus.jsonl --tokenizer-model tok.model --output-prefix out/c \\
        --train-tokenizer --vocab-size 512

First, where asked, a tokenizer is trained on the corpus (`train_tokenizer`: sentencepiece BPE; `train_hf_tokenizer`:
a byte-level BPE), from a bounded, seeded sample of it. Workers parse and tokenize chunks of lines (or record-batch
rows); the main process reads the files and writes the tokens in input order, so the output does not depend on the
number of workers or the format.
"""
import argparse
import io
import multiprocessing
import os
import random
import re
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy
import sentencepiece as spm
from tqdm import tqdm

from pretrain.atomic import write_atomically
from pretrain.data.corpus import (CHUNK_BYTES, Chunk, chunk_documents, expand_inputs, read_chunks,
                                  read_documents)
from pretrain.data.indexed import (IndexedWriter, check_indexed_dataset, token_dtype, tokenizer_record_path,
                                   write_tokenizer_record)
from pretrain.data.tokenizers import DEFAULT_EOD, KINDS, TextTokenizer, TokenizerSpec, byte_level, load_tokenizer
from pretrain.errors import EXIT_INPUT, DataError, TokenizerError

# ---- a tokenizer trained on the corpus
MAX_SENTENCES = 2_000_000  # sentences a tokenizer trains on, sampled from a bigger corpus
SAMPLE_SEED = 1234

# Fixed special ids so every model trained here agrees on them; pad stays off (-1) because
# GPT samples are cut from one unbroken token stream and never padded.
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


def _lines(documents: Iterable[str]) -> Iterator[str]:
    # sentencepiece trains on single lines (a newline never sits inside a training sentence);
    # newlines still encode at run time, through the byte-fallback piece <0x0A>.
    for document in documents:
        for line in document.split("\n"):
            if line.strip():
                yield line


def _clear_training_error(err: RuntimeError, vocab_size: int, corpus_name: str) -> TokenizerError:
    """Turn sentencepiece's internal assertion text into a message naming the requested size."""
    text = str(err)
    too_high = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", text)
    if too_high:
        return TokenizerError(
            f"vocab_size {vocab_size} is too large for corpus {corpus_name!r}: sentencepiece can "
            f"learn at most {too_high.group(1)} pieces from it; lower model.vocab_size or use a larger "
            "corpus")
    too_low = re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", text)
    if too_low:
        return TokenizerError(
            f"vocab_size {vocab_size} is too small for corpus {corpus_name!r}: the 256 byte-fallback "
            f"pieces, the special tokens and the corpus's characters need at least {too_low.group(1)}")
    return TokenizerError(f"training a tokenizer of vocab_size {vocab_size} on {corpus_name!r} failed: "
                          f"{text}")


def sample_sentences(sentences: Iterable[str], limit: int, seed: int = SAMPLE_SEED) -> list[str]:
    """At most `limit` sentences, a uniform sample (reservoir sampling, seeded) kept in corpus order.

    Memory stays bounded by `limit` however big the corpus; a corpus with fewer sentences is used whole.
    """
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    for number, sentence in enumerate(sentences):
        if number < limit:
            reservoir.append((number, sentence))
        elif (slot := rng.randrange(number + 1)) < limit:
            reservoir[slot] = (number, sentence)
    return [sentence for _, sentence in sorted(reservoir)]


def train_tokenizer(corpus: str | os.PathLike | Sequence[str | os.PathLike], model_prefix: str | os.PathLike,
                    vocab_size: int, max_sentences: int = MAX_SENTENCES, key: str = "text") -> Path:
    """Train a BPE model on the corpus (JSONL files or globs) and write it atomically to <model_prefix>.model.

    Deterministic: at most max_sentences lines, sampled with a fixed seed, in corpus order, one thread.
    byte_fallback makes any text encodable; identity normalisation and kept whitespace make
    decode(encode(text)) == text for all text without U+2581, the symbol sentencepiece uses for a space.
    """
    if max_sentences < 1:
        raise TokenizerError(f"max_sentences {max_sentences} must be at least 1")
    corpus_name = str(corpus) if isinstance(corpus, (str, os.PathLike)) else ", ".join(map(str, corpus))
    model_path = Path(f"{model_prefix}.model")
    # Sampled before training: sentencepiece would turn a DataError raised inside its iterator into
    # an opaque RuntimeError, and it keeps every sentence it is given in memory.
    sentences = sample_sentences(_lines(read_documents(corpus, key)), max_sentences)
    model_bytes = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model_bytes,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,  # indentation runs in code become single pieces
            split_digits=True,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=1,
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise _clear_training_error(err, vocab_size, corpus_name) from None
    model_path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(model_path, model_bytes.getvalue())  # never half a model under the real name


def train_hf_tokenizer(documents: Iterable[str], path: str | os.PathLike, vocab_size: int,
                       eod: str = DEFAULT_EOD) -> Path:
    """Train a byte-level BPE (GPT-2's scheme) with `tokenizers` and write its tokenizer.json atomically.

    vocab_size counts the 256 byte tokens, the merges and `eod`, added last (as GPT-2's 50256).
    Deterministic for the same documents; callers pass the same bounded sample sentencepiece trains on.
    """
    from tokenizers import Tokenizer as HF
    from tokenizers.models import BPE
    from tokenizers.pre_tokenizers import ByteLevel
    from tokenizers.trainers import BpeTrainer
    if vocab_size < 257:
        raise TokenizerError(f"vocab_size {vocab_size} is too small for a byte-level BPE: the 256 byte "
                             "tokens and the end-of-document token need at least 257")
    hf = byte_level(HF(BPE()))
    trainer = BpeTrainer(vocab_size=vocab_size - 1, initial_alphabet=ByteLevel.alphabet(), show_progress=False,
                         special_tokens=[])
    hf.train_from_iterator(documents, trainer=trainer)
    hf.add_special_tokens([eod])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomically(path, hf.to_str(pretty=True))


# ---- the corpus tokenized into .bin/.idx
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


def _spec(tokenizer: "TokenizerSpec | str | os.PathLike") -> TokenizerSpec:
    """A TokenizerSpec as it is, a path as a sentencepiece model."""
    return tokenizer if isinstance(tokenizer, TokenizerSpec) else TokenizerSpec("sentencepiece", str(tokenizer))


def _init_pool_worker(tokenizer: TokenizerSpec, key: str) -> None:
    """One of N worker processes: one thread each (no `tokenizers` thread pool per worker, no fork warning)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(tokenizer=load_tokenizer(tokenizer), key=key)


def tokenize_chunk(chunk: Chunk) -> TokenizedChunk:
    """Parse, tokenize and pack one chunk (runs in a worker; uses that worker's tokenizer)."""
    tokenizer: TextTokenizer = _worker["tokenizer"]
    documents, empty = chunk_documents(chunk, _worker["key"])
    ids = tokenizer.encode_batch(documents)
    for document in ids:
        document.append(tokenizer.eod_id)
    lengths = numpy.fromiter(map(len, ids), dtype=numpy.int64, count=len(ids))
    tokens = numpy.fromiter(chain.from_iterable(ids), dtype=token_dtype(tokenizer.vocab_size),
                            count=int(lengths.sum()))
    return TokenizedChunk(lengths, tokens, empty, chunk.bytes_done)


def tokenized_chunks(chunks: Iterable[Chunk], tokenizer: TextTokenizer, spec: TokenizerSpec, key: str,
                     workers: int) -> Iterator[TokenizedChunk]:
    """tokenize_chunk over the chunks, results in input order; `workers` processes (1: this one, with `tokenizer`;
    else each loads its own from `spec`).

    At most 2 × workers chunks are in flight (Pool.imap would read the whole corpus ahead into its
    task queue); leaving the generator early terminates the pool.
    """
    if workers == 1:
        _worker.update(tokenizer=tokenizer, key=key)
        yield from map(tokenize_chunk, chunks)
        return
    with multiprocessing.Pool(workers, initializer=_init_pool_worker, initargs=(spec, key)) as pool:
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


def tokenize_corpus(inputs: Sequence[str | os.PathLike], tokenizer_model: "TokenizerSpec | str | os.PathLike",
                    output_prefix: str | os.PathLike, workers: int = 1, key: str = "text",
                    progress: str = "off", log_interval_s: float = LOG_INTERVAL_S,
                    chunk_bytes: int = CHUNK_BYTES) -> PreprocessStats:
    """Tokenize every document of the inputs (files or globs) into <output_prefix>.bin/.idx.

    tokenizer_model: a TokenizerSpec, or the path of a sentencepiece model. key: the JSON field or the
    Parquet/Arrow column holding the text. progress: "auto" (bar on a terminal, else log lines), "bar",
    "log" or "off".
    """
    if workers < 1:
        raise DataError(f"workers {workers} must be at least 1")
    spec = _spec(tokenizer_model)
    files = expand_inputs(inputs)
    tokenizer = load_tokenizer(spec)
    return tokenize_files(files, spec, tokenizer, output_prefix, workers, key, progress, log_interval_s, chunk_bytes)


def tokenize_files(files: list[Path], spec: TokenizerSpec, tokenizer: TextTokenizer, output_prefix: str | os.PathLike,
                   workers: int = 1, key: str = "text", progress: str = "off", log_interval_s: float = LOG_INTERVAL_S,
                   chunk_bytes: int = CHUNK_BYTES) -> PreprocessStats:
    """tokenize_corpus of files already listed (expand_inputs) with `tokenizer`, loaded from `spec` (which each of
    `workers` processes loads anew)."""
    stats = PreprocessStats(files=len(files), dtype=token_dtype(tokenizer.vocab_size).__name__)
    start = time.perf_counter()
    meter = Progress(sum(f.stat().st_size for f in files), progress, log_interval_s)
    try:
        with IndexedWriter(output_prefix, tokenizer.vocab_size) as writer:
            for result in tokenized_chunks(read_chunks(files, chunk_bytes, key), tokenizer, spec, key, workers):
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
            # an older pair's record goes first: interrupted before the new one is written, the files are unrecorded
            tokenizer_record_path(output_prefix).unlink(missing_ok=True)
            writer.finish()
        write_tokenizer_record(output_prefix, tokenizer)
    finally:
        meter.close()
    stats.seconds = time.perf_counter() - start
    return stats


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m pretrain.preprocess", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, nargs="+",
                        help="files or globs: JSONL ({\"text\": ...} a line; .jsonl.gz, .jsonl.zst too), "
                             ".parquet, or Arrow IPC (.arrow, .feather; file or stream format)")
    text_kinds = [kind for kind in KINDS if kind != "none"]
    parser.add_argument("--tokenizer-kind", default="sentencepiece", choices=text_kinds,
                        help="what --tokenizer-model is (default %(default)s)")
    parser.add_argument("--tokenizer-model", required=True,
                        help="sentencepiece .model, hf tokenizer.json, gpt2_bpe vocab.json or tiktoken BPE file; "
                             "written with --train-tokenizer (sentencepiece, hf)")
    parser.add_argument("--tokenizer-merges", help="gpt2_bpe's merges.txt")
    parser.add_argument("--tokenizer-eod", help="end-of-document token of hf, gpt2_bpe, tiktoken "
                                                "(default <|endoftext|>)")
    parser.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    parser.add_argument("--text-column", "--json-key", dest="text_column", default="text",
                        help="the JSON field or Parquet/Arrow column holding each document's text")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenizing processes (default: all cores)")
    parser.add_argument("--train-tokenizer", action="store_true",
                        help="train a BPE tokenizer (sentencepiece, or hf byte-level) on --input first, saved "
                             "as --tokenizer-model")
    parser.add_argument("--vocab-size", type=int, help="vocabulary of the trained tokenizer")
    parser.add_argument("--tokenizer-sentences", type=int, default=MAX_SENTENCES,
                        help="lines (hf: documents) the tokenizer trains on, sampled from the corpus "
                             "(default %(default)s)")
    parser.add_argument("--log-interval", type=float, default=LOG_INTERVAL_S,
                        help="seconds between progress lines when stderr is not a terminal")
    args = parser.parse_args(argv)
    if args.train_tokenizer and args.vocab_size is None:
        parser.error("--train-tokenizer needs --vocab-size")
    if args.vocab_size is not None and not args.train_tokenizer:
        parser.error("--vocab-size only applies with --train-tokenizer")
    suffix = {"sentencepiece": ".model", "hf": ".json"}.get(args.tokenizer_kind)
    if args.train_tokenizer and suffix is None:
        parser.error(f"--train-tokenizer trains kinds sentencepiece and hf, not {args.tokenizer_kind}")
    if args.train_tokenizer and not args.tokenizer_model.endswith(suffix):
        parser.error(f"--tokenizer-model {args.tokenizer_model!r} must end in {suffix}")
    if (args.tokenizer_merges is None) != (args.tokenizer_kind != "gpt2_bpe"):
        parser.error("--tokenizer-merges (merges.txt) goes with --tokenizer-kind gpt2_bpe, and only with it")
    if args.tokenizer_eod is not None and args.tokenizer_kind == "sentencepiece":
        parser.error("--tokenizer-eod applies to kinds hf, gpt2_bpe and tiktoken (sentencepiece has its own)")
    if args.workers < 1:
        parser.error(f"--workers {args.workers} must be at least 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """0 when written; EXIT_INPUT (3) with one line on stderr when an input or the tokenizer is unusable."""
    args = parse_args(argv)
    spec = TokenizerSpec(args.tokenizer_kind, args.tokenizer_model, args.tokenizer_merges, args.tokenizer_eod)
    try:
        if args.train_tokenizer and args.tokenizer_kind == "hf":
            documents = sample_sentences(read_documents(args.input, args.text_column), args.tokenizer_sentences)
            train_hf_tokenizer(documents, args.tokenizer_model, args.vocab_size, args.tokenizer_eod or DEFAULT_EOD)
        elif args.train_tokenizer:
            train_tokenizer(args.input, args.tokenizer_model[: -len(".model")], args.vocab_size,
                            args.tokenizer_sentences, args.text_column)
        if args.train_tokenizer:
            print(f"trained tokenizer {args.tokenizer_model} (vocab_size {args.vocab_size})")
        stats = tokenize_corpus(args.input, spec, args.output_prefix, args.workers,
                                args.text_column, "auto", args.log_interval)
        check_indexed_dataset(args.output_prefix)
    except (DataError, TokenizerError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INPUT
    print(f"wrote {args.output_prefix}.bin and {args.output_prefix}.idx from {stats.files} file(s): "
          f"{stats.documents} documents ({stats.empty} empty skipped), {stats.tokens} tokens ({stats.dtype}), "
          f"{stats.input_bytes / 1e6:.1f} MB in {stats.seconds:.1f} s ({stats.tokens / stats.seconds:,.0f} tokens/s)")
    return 0
