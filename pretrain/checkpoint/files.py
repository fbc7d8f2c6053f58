"""Checkpoint files on disk: durable JSON and a SHA-256 manifest (DCP's files are read by pretrain.checkpoint.read)."""
import hashlib
import json
import os
from pathlib import Path

from pretrain.errors import InputError

MANIFEST = "checkpoint.json"


class CheckpointError(InputError):
    """A checkpoint that cannot be used, with the file and the reason (exit code 3, one line)."""

    def __init__(self, what: str, where: str = "checkpoint", fix: str = "", agreed=None):
        super().__init__(what, where, fix, agreed)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_durably(path: Path, obj) -> None:
    """Write JSON next to `path`, fsync it, rename it into place, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_text_durably(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


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
