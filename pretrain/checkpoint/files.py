"""Checkpoint files on disk: durable JSON and a SHA-256 manifest (DCP's files are read by pretrain.checkpoint.read)."""
import hashlib
import json
from pathlib import Path

from pretrain.atomic import fsync_path, write_atomically
from pretrain.errors import InputError

MANIFEST = "checkpoint.json"


class CheckpointError(InputError):
    """A checkpoint that cannot be used, with the file and the reason (exit code 3, one line)."""

    def __init__(self, what: str, where: str = "checkpoint", fix: str = "", agreed=None):
        super().__init__(what, where, fix, agreed)


def write_json_durably(path: Path, obj) -> None:
    """JSON as the whole of `path`, atomically and durably (pretrain/atomic.py)."""
    write_atomically(path, json.dumps(obj, indent=1, sort_keys=True), durable=True)


def read_json(path: Path) -> dict:
    """A JSON object from `path`, or a CheckpointError naming the file and what is wrong with it."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} cannot be read: {err}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is malformed JSON: {err}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is malformed: expected a JSON object, found {type(value).__name__}")
    return value


def file_record(path: Path) -> dict:
    """{"bytes", "sha256"} of a file, fsynced first so what is hashed is what is on disk."""
    fsync_path(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def verify_file(step_dir: Path, name: str, expected: dict) -> str:
    """'' when `name` matches its manifest record, else why not (missing, truncated, tampered)."""
    path = step_dir / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{path} has {size} bytes, the manifest records {expected['bytes']} (truncated or replaced)"
    if file_record(path)["sha256"] != expected["sha256"]:
        return f"{path} does not match its SHA-256 in {MANIFEST} (corrupted or tampered)"
    return ""
