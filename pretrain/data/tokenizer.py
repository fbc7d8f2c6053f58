"""The tokenizer interface every kind implements, and the sentencepiece kind: trained here or loaded.

The other kinds (a Hugging Face tokenizer.json, GPT-2's vocab.json + merges.txt, a tiktoken BPE file,
and "none" for token files made elsewhere) live in pretrain/data/tokenizers.py.
"""
import hashlib
import io
import os
import random
import re
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import sentencepiece as spm

from pretrain.atomic import write_atomically
from pretrain.data.corpus import read_documents
from pretrain.errors import DataError, TokenizerError

MAX_SENTENCES = 2_000_000  # sentences a tokenizer trains on, sampled from a bigger corpus
SAMPLE_SEED = 1234

# Fixed special ids so every model trained here agrees on them; pad stays off (-1) because
# GPT samples are cut from one unbroken token stream and never padded.
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


class TextTokenizer:
    """What the data pipeline asks of a tokenizer, whatever its kind.

    Subclasses set `kind` and `files` (every file the tokenizer reads) and implement encode, decode,
    vocab_size and eod_id; `eod_id` is appended after every document.
    """

    kind: str = ""
    files: tuple[Path, ...] = ()

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def eod_id(self) -> int:
        raise NotImplementedError

    @property
    def bos_id(self) -> Optional[int]:
        """The beginning-of-sequence id, or None where the kind has none (zero3d never inserts it)."""
        return None

    @property
    def model_path(self) -> Optional[Path]:
        """The main file (model, tokenizer.json, vocab.json, BPE file); None for kind "none"."""
        return self.files[0] if self.files else None

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def identity(self) -> dict:
        """What besides the files' bytes decides the ids (the kind, its settings)."""
        return {"kind": self.kind}

    def files_sha256(self) -> str:
        """SHA-256 over the kind, its settings and the bytes of every file the tokenizer reads (in order):
        the tokenizer's part of a checkpoint's identity and of the token cache's key."""
        digest = hashlib.sha256(repr(sorted(self.identity().items())).encode())
        for path in self.files:
            digest.update(b"\0" + hashlib.sha256(Path(path).read_bytes()).digest())
        return digest.hexdigest()


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


class Tokenizer(TextTokenizer):
    """Kind "sentencepiece": a loaded sentencepiece model (zero3d's own trained tokenizer)."""

    kind = "sentencepiece"

    def __init__(self, model_path: str | os.PathLike):
        self.files = (Path(model_path),)
        if not self.model_path.is_file():
            raise TokenizerError(f"tokenizer model {str(self.model_path)!r} does not exist")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(self.model_path))
        except (OSError, RuntimeError) as err:
            raise TokenizerError(
                f"tokenizer model {str(self.model_path)!r} is not a sentencepiece model: {err}") from None
        if self._sp.eos_id() < 0:
            raise TokenizerError(
                f"tokenizer model {str(self.model_path)!r} has no end-of-sequence piece; "
                "documents need one to be separated (train it with eos_id set)")

    @property
    def vocab_size(self) -> int:
        return self._sp.vocab_size()

    @property
    def bos_id(self) -> Optional[int]:
        return self._sp.bos_id() if self._sp.bos_id() >= 0 else None

    @property
    def eod_id(self) -> int:
        """Appended after every document, as Megatron's preprocess_data does with --append-eod."""
        return self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """encode() of each text, in one call into sentencepiece."""
        return self._sp.encode(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def check_vocab(tokenizer: "TextTokenizer", model_vocab_size: int) -> None:
    """DataError when the tokenizer's ids would not fit the model's embedding (model.vocab_size)."""
    if tokenizer.vocab_size > model_vocab_size:
        raise DataError(f"tokenizer vocabulary {tokenizer.vocab_size} is larger than model.vocab_size "
                        f"{model_vocab_size}; raise model.vocab_size or use a smaller tokenizer "
                        f"({tokenizer.model_path})")
