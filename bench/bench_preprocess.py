"""Preprocessing throughput (tokens/s): pretrain.data.preprocess with 1, 2 and all cores against today's code.

    python bench/bench_preprocess.py [--size-mb 200] [--vocab 1024] [--baseline-commit b96830b]

Generates a JSONL corpus of at least --size-mb MB in a temporary directory (the shipped corpus's
documents, repeated with a copy number so no two documents are equal; deleted afterwards), trains
one tokenizer on the shipped corpus, then tokenizes the big corpus:

    baseline  the single-process pretrain/data.py preprocess() of --baseline-commit, taken from git
              (`git show`) into the temporary directory: the code this module replaced
    workers=N pretrain.data.preprocess.tokenize_corpus with N worker processes (1: in-process)

Every row must write the same .bin bytes as the baseline. Throughput is tokens written per second of
wall time, read + tokenize + write; ratios are against the baseline in the same run.
"""
import argparse
import hashlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pretrain.data.preprocess import tokenize_corpus, train_tokenizer  # noqa: E402
from pretrain.data.indexed import token_dtype  # noqa: E402

CORPUS = REPO / "data" / "corpus.jsonl"


def generate_corpus(path: Path, size_mb: float) -> int:
    """Copies of the shipped corpus's documents until the file holds size_mb MB; returns its bytes."""
    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines() if line.strip()]
    written, copy = 0, 0
    with path.open("w") as out:
        while written < size_mb * 1e6:
            for text in texts:
                written += out.write(json.dumps({"text": f"{text}\n(copy {copy})"}) + "\n")
            copy += 1
    return path.stat().st_size


def load_baseline(commit: str, directory: Path):
    """The baseline's pretrain/data.py and tokenizer.py as package `baseline_pretrain` in directory."""
    package = directory / "baseline_pretrain"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("data.py", "tokenizer.py"):
        source = subprocess.run(["git", "show", f"{commit}:pretrain/{name}"], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout
        (package / name).write_text(source.replace("from pretrain.", "from baseline_pretrain."))
    sys.path.insert(0, str(directory))
    return importlib.import_module("baseline_pretrain.data")


def digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=200.0)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--baseline-commit", default="b96830b")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="bench_preprocess_") as tmp:
        tmp = Path(tmp)
        corpus = tmp / "corpus.jsonl"
        size = generate_corpus(corpus, args.size_mb)
        model = train_tokenizer(CORPUS, tmp / "tok", args.vocab)
        print(f"corpus: {size / 1e6:.1f} MB of JSONL; tokenizer vocab {args.vocab}; {cores} cores "
              f"(load average {os.getloadavg()[0]:.1f} at start)")
        baseline = load_baseline(args.baseline_commit, tmp)
        start = time.perf_counter()
        baseline.preprocess(corpus, baseline.Tokenizer(model), tmp / "baseline")
        seconds = time.perf_counter() - start
        tokens = Path(tmp / "baseline.bin").stat().st_size // token_dtype(args.vocab)().itemsize
        expected = digest(str(tmp / "baseline.bin"))
        rows = [(f"baseline (git {args.baseline_commit}, 1 process)", seconds, tokens)]
        for workers in dict.fromkeys([1, 2, cores]):
            stats = tokenize_corpus([corpus], model, tmp / f"w{workers}", workers=workers)
            if digest(str(tmp / f"w{workers}.bin")) != expected:
                raise SystemExit(f"workers={workers} wrote other tokens than the baseline")
            rows.append((f"pretrain.data.preprocess --workers {workers}", stats.seconds, stats.tokens))
            os.remove(tmp / f"w{workers}.bin")
        base_rate = rows[0][2] / rows[0][1]
        print(f"\n| run | seconds | tokens | tokens/s | vs baseline |\n| --- | ---: | ---: | ---: | ---: |")
        for name, seconds, tokens in rows:
            print(f"| {name} | {seconds:.1f} | {tokens:,} | {tokens / seconds:,.0f} | "
                  f"{tokens / seconds / base_rate:.2f}x |")
        print(f"\nload average at end {os.getloadavg()[0]:.1f}; all rows wrote identical .bin bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
