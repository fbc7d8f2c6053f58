"""Paths a run writes and reads, checked before any process group starts (no torch here)."""
import glob
import importlib.util
import os
from pathlib import Path
from typing import Optional

from pretrain.config import Config
from pretrain.errors import ConfigError, InputError


def _directory_setting(key: str, value: Optional[str | Path]) -> None:
    """A directory the run will create or write into: not a file, under no file, writable."""
    if value is None:
        return
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{key} = {str(path)!r} is an existing file, not a directory",
                          fix=f"set {key} to a directory path (or remove the file)")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{key} = {str(path)!r} lies under {str(existing)!r}, which is a file",
                          fix=f"set {key} to a path under a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key} = {str(path)!r} cannot be created: {str(existing)!r} is not writable",
                          fix=f"set {key} to a writable location")


def _relative_note(path: str | Path) -> str:
    """Relative paths in a config resolve against the working directory, not the config file's."""
    return "" if Path(path).is_absolute() else f" (relative to the working directory {os.getcwd()})"


def _input_file(key: str, path: str | Path, fix: str) -> None:
    if not Path(path).is_file():
        what = "is a directory" if Path(path).is_dir() else "does not exist"
        raise InputError(f"{key} = {str(path)!r} {what}{_relative_note(path)}", "input files", fix)


GPT2_FILES_DOC = "slurm/README.md, Data"  # where to get GPT-2's vocab.json and merges.txt, and where they go


def _gpt2_bpe_files(vocab: str, merges: str) -> None:
    """GPT-2's vocab.json (data.tokenizer_model) and merges.txt (data.tokenizer_merges), supplied by the user: the
    first missing one named, with where GPT-2's files go (and the other too when it is missing as well)."""
    files = (("data.tokenizer_model", vocab, "vocab.json"), ("data.tokenizer_merges", merges, "merges.txt"))
    missing = [(key, path, name) for key, path, name in files if not Path(path).is_file()]
    if not missing:
        return
    (key, path, name), others = missing[0], missing[1:]
    keys = " and ".join(k for k, _, _ in missing)
    fix = (f"put GPT-2's {name} there" + "".join(f" and its {n} at {str(p)!r}" for _, p, n in others)
           + f" ({GPT2_FILES_DOC}), or point {keys} at your {'copies' if others else 'copy'}")
    _input_file(key, path, fix)


NO_DATA_FIX = ('name it: data.blend = "<prefix>" (.bin/.idx written by python -m pretrain.preprocess), or data.corpus = '
               '"<JSONL, Parquet or Arrow file or glob>" (data/corpus.jsonl is the shipped demo corpus)')


def check_names_data(d) -> None:
    """A run trains on the data its config names: no corpus and no blend is refused, not the demo corpus."""
    if d.corpus is None and not d.blends():
        raise ConfigError("no data to train on: data.corpus, data.blend and data.train_blend are all unset",
                          fix=NO_DATA_FIX)


def check_paths(cfg: Config) -> None:
    """Directories the run writes and input files it reads, checked before any process group starts."""
    _directory_setting("logging.run_dir", cfg.run_dir)
    if cfg.logging.wandb:  # WANDB_MODE as wandb would read it, refused in one line before any rank starts
        from pretrain.metrics import wandb_mode
        wandb_mode(os.environ)
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise InputError("logging.tensorboard = true but the tensorboard package is not installed", "environment",
                         "install it (pip install tensorboard==2.21.0, pyproject.toml's pin) or set "
                         "logging.tensorboard = false")
    _directory_setting("train.save_dir", cfg.train.save_dir)
    _directory_setting("data.cache_dir", cfg.data.cache_dir)
    d = cfg.data
    check_names_data(d)
    if d.tokenizer_kind == "gpt2_bpe":
        _gpt2_bpe_files(d.tokenizer_model, d.tokenizer_merges)
    elif d.tokenizer_model is not None:
        what = {"sentencepiece": "a sentencepiece .model file", "hf": "a Hugging Face tokenizer.json",
                "tiktoken": "a tiktoken BPE file"}[d.tokenizer_kind]
        trained = ", or unset it to train one from data.corpus" if d.tokenizer_kind in ("sentencepiece", "hf") else ""
        _input_file("data.tokenizer_model", d.tokenizer_model, f"point it at {what}{trained}")
    blends = d.blends()
    for key, (prefixes, _) in blends.items():
        for prefix in prefixes:
            for suffix in (".bin", ".idx"):
                _input_file(f"data.{key}", f"{prefix}{suffix}",
                            f"{prefix}{suffix} is missing; run python -m pretrain.preprocess to write it, or "
                            f"fix the prefix in data.{key}")
    if not blends:
        fix = 'point data.corpus at JSONL files ({"text": ...} a line; .gz/.zst too), Parquet or Arrow files, or a glob'
        if glob.has_magic(d.corpus):
            if not glob.glob(d.corpus, recursive=True):
                raise InputError(f"data.corpus = {d.corpus!r} matches no file{_relative_note(d.corpus)}",
                                 "input files", fix)
        else:
            _input_file("data.corpus", d.corpus, fix)
