"""A tiny tokenizer in GPT-2's file format (vocab.json + merges.txt) standing in for GPT-2's own, which the paper
configs name and the user supplies (configs/generate_paper.py): written by the tests, never downloaded."""
import json
from pathlib import Path

EOD = "<|endoftext|>"
MERGES = (("Ġ", "t"), ("h", "e"), ("Ġt", "he"))  # enough to make " the" one token


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table (its encoder.py): printable bytes stand for themselves, the rest are
    shifted past 255, so every byte has a visible character; in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def write_gpt2_files(directory: Path) -> tuple[Path, Path]:
    """(vocab.json, merges.txt) in `directory`: the 256 byte tokens, MERGES' results and the end-of-document token
    last, as GPT-2's 50256 (260 tokens)."""
    tokens = byte_alphabet() + [a + b for a, b in MERGES] + [EOD]
    directory.mkdir(parents=True, exist_ok=True)
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    vocab.write_text(json.dumps({token: i for i, token in enumerate(tokens)}, ensure_ascii=False))
    merges.write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES))
    return vocab, merges


def gpt2_overrides(directory: Path) -> list[str]:
    """Config overrides naming the test files written into `directory` in place of GPT-2's."""
    vocab, merges = write_gpt2_files(directory)
    return [f"data.tokenizer_model={vocab}", f"data.tokenizer_merges={merges}"]
