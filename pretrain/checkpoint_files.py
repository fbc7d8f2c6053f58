"""Checkpoint files on disk: durable JSON, a SHA-256 manifest, and DCP metadata read without unsafe pickle."""
import hashlib
import io
import json
import os
import pickle
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader

from pretrain.errors import InputError

MANIFEST = "checkpoint.json"
DCP_METADATA = ".metadata"


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


# What DCP's .metadata pickle may name: its own metadata dataclasses and the torch/builtin types in them.
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch", "Size"), ("torch", "float32"), ("torch", "float16"), ("torch", "bfloat16"),
    ("torch", "float64"), ("torch", "int64"), ("torch", "int32"), ("torch", "uint8"), ("torch", "bool"),
    ("torch", "strided"), ("torch", "contiguous_format"), ("torch", "preserve_format"),
    ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("builtins", "slice"), ("builtins", "getattr"),
    ("torch.serialization", "_get_layout"),
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only the classes DCP's metadata is made of; anything else (os.system, ...) is refused."""

    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module, name):
        if (module, name) not in _SAFE_GLOBALS:
            raise CheckpointError(f"{self.source} asks to load {module}.{name}, which is not part of DCP's "
                                  "checkpoint metadata; refusing to unpickle it")
        return super().find_class(module, name)


def read_dcp_metadata(step_dir: Path):
    """DCP's Metadata object from `<step_dir>/.metadata` through the restricted unpickler."""
    path = step_dir / DCP_METADATA
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    try:
        return RestrictedUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any unpickling failure is a malformed file
        raise CheckpointError(f"{path} is malformed: {type(err).__name__}: {err}") from None


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read by `read_dcp_metadata` (DCP itself uses pickle.load).
    Tensor data DCP already reads with torch.load(weights_only=True)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta
        metadata = read_dcp_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
