"""What a tokenizer is and how to load it: one interface (TextTokenizer), five kinds, `load_tokenizer`, the checks.

  "sentencepiece"  a sentencepiece .model (one trained here: pretrain/data/preprocess.py)
  "hf"             a Hugging Face tokenizer.json, through the `tokenizers` library (or one trained here: byte-level
                   BPE, pretrain/data/preprocess.py)
  "gpt2_bpe"       GPT-2's vocab.json + merges.txt: `tokenizers`' byte-level BPE from those files, GPT-2's ids
  "tiktoken"       a tiktoken BPE ranks file, loaded locally, split with GPT-2's pattern (GPT2_PATTERN)
  "none"           token files made elsewhere: no tokenizer file, ids are the vocabulary (megatron's NullTokenizer)

Nothing is downloaded: every kind reads only the files it is given. A checkpoint's identity holds a tokenizer's
`identity_sha256` (the hash of `identity_path`'s file).
"""
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import sentencepiece as spm

from pretrain.atomic import write_atomically
from pretrain.errors import DataError, TokenizerError
from pretrain.sections import DataConfig

KINDS = ("sentencepiece", "hf", "gpt2_bpe", "tiktoken", "none")
DEFAULT_EOD = "<|endoftext|>"
# tiktoken's "gpt2" split pattern (the regex of `tokenizers`' ByteLevel pre-tokenizer, GPT-2's encoder.py).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


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


def _existing(path: str | os.PathLike, what: str) -> Path:
    if not Path(path).is_file():
        raise TokenizerError(f"{what} {str(path)!r} does not exist")
    return Path(path)


def byte_level(tokenizer):
    """GPT-2's byte-level pre-tokenizer and decoder on a `tokenizers` model (no prefix space added)."""
    from tokenizers import decoders, pre_tokenizers
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


class _HFBased(TextTokenizer):
    """A `tokenizers.Tokenizer`; the end-of-document id is the id of the token string `eod`."""

    def _setup(self, hf, eod: str, source: str) -> None:
        self._hf, self.eod = hf, eod
        self._eod_id = hf.token_to_id(eod)
        if self._eod_id is None:
            raise TokenizerError(f"tokenizer {source} has no token {eod!r} to end documents with; set "
                                 "data.tokenizer_eod (--tokenizer-eod) to one of its tokens")

    @property
    def backend(self):
        """The `tokenizers.Tokenizer` that encodes (export --format hf saves it as tokenizer.json)."""
        return self._hf

    @property
    def vocab_size(self) -> int:
        return self._hf.get_vocab_size(with_added_tokens=True)

    @property
    def eod_id(self) -> int:
        return self._eod_id

    def encode(self, text: str) -> list[int]:
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def identity(self) -> dict:
        return {"kind": self.kind, "eod": self.eod}


class HFTokenizer(_HFBased):
    """Kind "hf": a Hugging Face tokenizer.json."""
    kind = "hf"

    def __init__(self, path: str | os.PathLike, eod: Optional[str] = None):
        from tokenizers import Tokenizer as HF
        self.files = (_existing(path, "tokenizer.json"),)
        try:
            hf = HF.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for a malformed file
            raise TokenizerError(f"tokenizer.json {str(path)!r} is not a Hugging Face tokenizer: {err}") from None
        self._setup(hf, eod or DEFAULT_EOD, repr(str(path)))


class GPT2BPETokenizer(_HFBased):
    """Kind "gpt2_bpe": GPT-2's vocab.json + merges.txt as `tokenizers`' byte-level BPE (GPT-2's ids)."""
    kind = "gpt2_bpe"

    def __init__(self, vocab: str | os.PathLike, merges: str | os.PathLike, eod: Optional[str] = None):
        from tokenizers import Tokenizer as HF
        from tokenizers.models import BPE
        self.files = (_existing(vocab, "vocab.json"), _existing(merges, "merges.txt"))
        try:
            hf = byte_level(HF(BPE.from_file(str(vocab), str(merges))))
        except Exception as err:
            raise TokenizerError(f"vocab.json {str(vocab)!r} and merges.txt {str(merges)!r} are not a GPT-2 "
                                 f"BPE: {err}") from None
        self._setup(hf, eod or DEFAULT_EOD, f"{str(vocab)!r}")


class TiktokenTokenizer(TextTokenizer):
    """Kind "tiktoken": a tiktoken BPE ranks file (base64 token, rank a line), GPT2_PATTERN, and the
    end-of-document string added as a special token after the highest rank (as GPT-2's 50256)."""
    kind = "tiktoken"

    def __init__(self, path: str | os.PathLike, eod: Optional[str] = None):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe
        self.files = (_existing(path, "tiktoken BPE file"),)
        self.eod = eod or DEFAULT_EOD
        try:
            ranks = load_tiktoken_bpe(str(path))
        except Exception as err:
            raise TokenizerError(f"tiktoken BPE file {str(path)!r} does not parse (base64 token and rank a "
                                 f"line): {err}") from None
        if not ranks:
            raise TokenizerError(f"tiktoken BPE file {str(path)!r} holds no token")
        self._eod_id = max(ranks.values()) + 1
        self._enc = tiktoken.Encoding(f"zero3d:{Path(path).name}", pat_str=GPT2_PATTERN,
                                      mergeable_ranks=ranks, special_tokens={self.eod: self._eod_id})

    @property
    def vocab_size(self) -> int:
        return self._enc.n_vocab

    @property
    def eod_id(self) -> int:
        return self._eod_id

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])

    def identity(self) -> dict:
        return {"kind": self.kind, "eod": self.eod, "pattern": GPT2_PATTERN}


class NullTokenizer(TextTokenizer):
    """Kind "none" (megatron's NullTokenizer): .bin/.idx made elsewhere, ids 0..vocab_size-1 with a given
    end-of-document id; its "text" is the ids written in decimal, separated by spaces."""
    kind = "none"

    def __init__(self, vocab_size: int, eod_id: int):
        if not 0 <= eod_id < vocab_size:
            raise TokenizerError(f"data.eod_id = {eod_id} is outside the vocabulary 0..{vocab_size - 1} "
                                 "(model.vocab_size)")
        self._vocab_size, self._eod_id = vocab_size, eod_id

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod_id(self) -> int:
        return self._eod_id

    def encode(self, text: str) -> list[int]:
        return [int(word) for word in text.split()]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def identity(self) -> dict:
        return {"kind": self.kind, "vocab_size": self._vocab_size, "eod_id": self._eod_id}


@dataclass(frozen=True)
class TokenizerSpec:
    """How to load a tokenizer: picklable, so preprocessing workers load their own."""
    kind: str = "sentencepiece"
    model: Optional[str] = None  # .model, tokenizer.json, vocab.json or the tiktoken BPE file
    merges: Optional[str] = None  # gpt2_bpe's merges.txt
    eod: Optional[str] = None  # the end-of-document token string (hf, gpt2_bpe, tiktoken)
    vocab_size: Optional[int] = None  # kind "none": model.vocab_size
    eod_id: Optional[int] = None  # kind "none"

    def load(self) -> TextTokenizer:
        return load_tokenizer(self)


def spec_of(data, vocab_size: int) -> TokenizerSpec:
    """The tokenizer a DataConfig's keys name; vocab_size: model.vocab_size, the vocabulary of kind none."""
    return TokenizerSpec(data.tokenizer_kind, data.tokenizer_model, data.tokenizer_merges, data.tokenizer_eod,
                         vocab_size if data.tokenizer_kind == "none" else None, data.eod_id)


def load_tokenizer(spec: TokenizerSpec) -> TextTokenizer:
    """The tokenizer `spec` names; TokenizerError (one line naming the file) when it cannot be loaded."""
    if spec.kind not in KINDS:
        raise TokenizerError(f"tokenizer kind {spec.kind!r} is unknown; kinds: {', '.join(KINDS)}")
    if spec.kind == "none":
        return NullTokenizer(int(spec.vocab_size), int(spec.eod_id))
    if spec.model is None:
        raise TokenizerError(f"tokenizer kind {spec.kind!r} needs a file (data.tokenizer_model)")
    if spec.kind == "sentencepiece":
        return Tokenizer(spec.model)
    if spec.kind == "hf":
        return HFTokenizer(spec.model, spec.eod)
    if spec.kind == "gpt2_bpe":
        if spec.merges is None:
            raise TokenizerError("tokenizer kind 'gpt2_bpe' needs merges.txt (data.tokenizer_merges) beside "
                                 "vocab.json (data.tokenizer_model)")
        return GPT2BPETokenizer(spec.model, spec.merges, spec.eod)
    return TiktokenTokenizer(spec.model, spec.eod)


def check_vocab(tokenizer: "TextTokenizer", model_vocab_size: int) -> None:
    """DataError when the tokenizer's ids would not fit the model's embedding (model.vocab_size)."""
    if tokenizer.vocab_size > model_vocab_size:
        raise DataError(f"tokenizer vocabulary {tokenizer.vocab_size} is larger than model.vocab_size "
                        f"{model_vocab_size}; raise model.vocab_size or use a smaller tokenizer "
                        f"({tokenizer.model_path})")


def check_eod(tokenizer: TextTokenizer, data: DataConfig) -> None:
    """Document boundaries are found by the end-of-document id: a tokenizer without one is refused."""
    if data.document_keys() and not 0 <= tokenizer.eod_id < tokenizer.vocab_size:
        keys = ", ".join(f"data.{key} = true" for key in data.document_keys())
        raise DataError(f"{keys} needs an end-of-document id, but the {tokenizer.kind} tokenizer "
                        f"{tokenizer.model_path} has none (eod id {tokenizer.eod_id}); use a tokenizer with one "
                        "(sentencepiece: an eos piece)")


def identity_path(tokenizer: TextTokenizer, spec: TokenizerSpec, cache_dir: str | os.PathLike) -> str:
    """The file a checkpoint's identity hashes for `tokenizer`: the sentencepiece .model, or for the other kinds a
    small JSON in cache_dir holding the kind, its settings and `files_sha256`; written once, atomically."""
    if spec.kind == "sentencepiece":
        return str(spec.model)
    record = _identity_record(tokenizer)
    path = Path(cache_dir) / f"tokenizer-identity-{hashlib.sha256(record.encode()).hexdigest()[:16]}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, record + "\n")
    return str(path)


def _identity_record(tokenizer: TextTokenizer) -> str:
    return json.dumps({**tokenizer.identity(), "files_sha256": tokenizer.files_sha256()}, sort_keys=True)


def identity_sha256(tokenizer: TextTokenizer, spec: TokenizerSpec) -> str:
    """The tokenizer_sha256 a checkpoint's identity holds for this tokenizer: the SHA-256 of identity_path's file."""
    if spec.kind == "sentencepiece":
        return hashlib.sha256(Path(spec.model).read_bytes()).hexdigest()
    return hashlib.sha256((_identity_record(tokenizer) + "\n").encode()).hexdigest()
