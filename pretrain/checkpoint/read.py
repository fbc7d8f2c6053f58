"""The one way a checkpoint is read: DCP's .metadata unpickled from an allow-list, validated, tensors read bounded.

Every file is held to its record in checkpoint.json (its size and SHA-256: `file_record`, `verify_file`) before it is
read; a JSON file that cannot be read is a CheckpointError naming it (`read_json`).
"""
import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType

from optim import ADAMW, OptimizerSpec
from pretrain.atomic import fsync_path
from pretrain.checkpoint.unpickler import DTYPES, unpickle_metadata
from pretrain.errors import CheckpointError

MANIFEST = "checkpoint.json"
DCP_METADATA = ".metadata"

_SHARD_NAME = re.compile(r"__\d+_\d+\.distcp")


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


def _check(ok: bool, path: Path, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{path} is malformed: {what}")


def _ints(value, n=None) -> bool:
    return (isinstance(value, torch.Size) and all(type(v) is int and v >= 0 for v in value)
            and (n is None or len(value) == n))


def validate_metadata(md, step_dir: Path) -> dict:
    """Every field of a DCP Metadata checked (types, shapes, chunk boxes, storage ranges within the real
    file sizes); returns {file name: size}. Only tensor records: zero3d never writes a byte record."""
    try:
        return _validate(md, step_dir, step_dir / DCP_METADATA)
    except (AttributeError, TypeError) as err:  # an object left without a field it needs
        raise CheckpointError(f"{step_dir / DCP_METADATA} is malformed: {type(err).__name__}: "
                              f"{str(err)[:200]}") from None


def _validate(md, step_dir: Path, path: Path) -> dict:
    _check(type(md) is Metadata, path, f"a {type(md).__name__}, not DCP's Metadata")
    _check(type(md.state_dict_metadata) is dict and md.state_dict_metadata, path, "no tensor records")
    chunks = {}
    for key, rec in md.state_dict_metadata.items():
        _check(type(key) is str, path, f"record key {key!r} is not a string")
        _check(type(rec) is TensorStorageMetadata, path,
               f"record {key!r} is a {type(rec).__name__}; only tensor records are accepted")
        props = rec.properties
        _check(type(props) is TensorProperties and props.dtype in DTYPES.values()
               and props.layout is torch.strided and props.requires_grad is False and props.pin_memory is False,
               path, f"record {key!r} has properties {props!r}")
        _check(_ints(rec.size) and type(rec.chunks) is list, path, f"record {key!r} has size {rec.size!r}")
        for chunk in rec.chunks:
            _check(type(chunk) is ChunkStorageMetadata and _ints(chunk.offsets, len(rec.size))
                   and _ints(chunk.sizes, len(rec.size))
                   and all(o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, rec.size)),
                   path, f"record {key!r} has a chunk outside its shape {tuple(rec.size)}: {chunk!r}")
            chunks[(key, tuple(chunk.offsets))] = chunk
    _check(type(md.storage_data) is dict, path, "storage_data is not a dict")
    _check(md.planner_data is None or type(md.planner_data) is dict, path, "planner_data is not a dict")
    _check(md.version is None or type(md.version) is str, path, "version is not a string")
    _check(md.storage_meta is None or type(md.storage_meta) is StorageMeta, path, "storage_meta is malformed")
    sizes, seen = {}, set()
    for index, info in md.storage_data.items():
        _check(type(index) is MetadataIndex and type(index.fqn) is str and _ints(index.offset)
               and (index.index is None or type(index.index) is int), path, f"storage key {index!r}")
        where = (index.fqn, tuple(index.offset))
        _check(where in chunks, path, f"storage entry {index.fqn!r} at {where[1]} names no chunk of a record")
        seen.add(where)
        _check(type(info) is _StorageInfo and type(info.relative_path) is str
               and _SHARD_NAME.fullmatch(info.relative_path) is not None, path,
               f"storage of {index.fqn!r} is in {getattr(info, 'relative_path', None)!r}, not a __<r>_<n>.distcp "
               "file of the step directory")
        _check(type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length > 0
               and not info.transform_descriptors, path,
               f"storage of {index.fqn!r}: offset {info.offset!r}, length {info.length!r}, transforms "
               f"{info.transform_descriptors!r} (non-negative ints, a positive length, no transforms)")
        name = info.relative_path
        if name not in sizes:
            try:
                sizes[name] = os.stat(step_dir / name).st_size
            except OSError as err:
                raise CheckpointError(f"{step_dir / name} cannot be read: {err.strerror}") from None
        _check(info.offset + info.length <= sizes[name], path,
               f"storage of {index.fqn!r} is bytes [{info.offset}, {info.offset + info.length}) of {name}, "
               f"which has {sizes[name]} bytes")
    missing = set(chunks) - seen
    if missing:
        raise CheckpointError(f"{path} is malformed: {len(missing)} chunks have no storage entry, "
                              f"e.g. {sorted(missing)[0]}")
    return sizes


def read_dcp_metadata(step_dir: Path):
    """DCP's Metadata of `step_dir`, unpickled from the allow-list and validated (validate_metadata)."""
    md = unpickle_metadata(step_dir / DCP_METADATA)
    validate_metadata(md, step_dir)
    return md


# A tensor may load into a wider dtype only where every value converts exactly: bf16 optimizer states resumed as
# fp32 ones (optimizer.state_dtype; check_optimizer refuses the other direction).
EXACT_WIDENINGS = {(torch.bfloat16, torch.float32)}


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, its metadata and its data reads replaced: byte items refused, each tensor read
    from its validated range with torch.load(weights_only=True) and checked against its chunk."""

    def read_metadata(self, *args, **kwargs):
        metadata = read_dcp_metadata(Path(self.path))
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def read_data(self, plan, planner):
        step_dir = Path(self.path)
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise CheckpointError(f"{step_dir}: a byte record {req.storage_index.fqn!r} was asked for; "
                                      "zero3d checkpoints hold tensors only")
            info = self.storage_data[req.storage_index]
            try:
                with open(step_dir / info.relative_path, "rb") as f:
                    f.seek(info.offset)
                    data = f.read(info.length)
                if len(data) != info.length:
                    raise ValueError(f"{len(data)} of {info.length} bytes")
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as err:  # noqa: BLE001 - damaged bytes: a checkpoint error naming the file
                raise CheckpointError(f"{step_dir / info.relative_path}: tensor {req.storage_index.fqn!r} cannot "
                                      f"be read: {type(err).__name__}: {str(err).splitlines()[0][:200]}") from None
            target = planner.resolve_tensor(req).detach()
            where = f"{step_dir / info.relative_path}: tensor {req.storage_index.fqn!r}"
            if type(tensor) is not torch.Tensor or (tensor.dtype != target.dtype
                                                    and (tensor.dtype, target.dtype) not in EXACT_WIDENINGS):
                raise CheckpointError(f"{where} holds {getattr(tensor, 'dtype', type(tensor).__name__)}, "
                                      f"expected {target.dtype}")
            try:
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    tensor = tensor.narrow(dim, start, length)
            except (RuntimeError, IndexError) as err:
                raise CheckpointError(f"{where} does not fit its chunk: {str(err).splitlines()[0][:200]}") from None
            if tensor.shape != target.shape:
                raise CheckpointError(f"{where} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


def load_dcp(state: dict, step_dir: Path, **kwargs) -> None:
    """dcp.load through SafeFileSystemReader; a failure on any rank becomes that rank's CheckpointError."""
    import torch.distributed.checkpoint as dcp
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(step_dir), **kwargs)
    except CheckpointException as err:
        failures = [exc for exc, _ in err.failures.values()]
        first = next((e for e in failures if isinstance(e, CheckpointError)), None)
        if first is not None:
            raise CheckpointError(first.what, first.where, first.fix) from None
        raise CheckpointError(f"{step_dir} cannot be read: " + "; ".join(
            f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}" for e in failures)) from None


FORMAT = "zero3d-dcp-1"
_LISTED_NAME = re.compile(r"\.metadata|__\d+_\d+\.distcp|rng/rank_\d{5}\.json")


def read_manifest(step_dir: Path) -> dict:
    """checkpoint.json of `step_dir`: a zero3d manifest whose step is the directory's and whose files are
    the step directory's own names, each with its size and SHA-256."""
    path = step_dir / MANIFEST
    manifest = read_json(path)
    files = manifest.get("files")
    _check(manifest.get("format") == FORMAT and isinstance(files, dict), path, f"not a {FORMAT} manifest")
    step = manifest.get("step")
    _check(type(step) is int and step >= 0 and step_dir.name == f"step_{step:08d}", path,
           f"its step {step!r} is not the step of its directory {step_dir.name}")
    for name, rec in files.items():
        _check(_LISTED_NAME.fullmatch(name) is not None, path, f"lists {name!r}, not a file of a checkpoint")
        _check(type(rec) is dict and type(rec.get("bytes")) is int and type(rec.get("sha256")) is str, path,
               f"the record of {name} is {rec!r}")
    return manifest


def check_listed(step_dir: Path, manifest: dict, metadata) -> None:
    """Every file the DCP metadata references is listed (and so verified) in the manifest."""
    unlisted = sorted(({DCP_METADATA} | {info.relative_path for info in metadata.storage_data.values()})
                      - set(manifest["files"]))
    if unlisted:
        raise CheckpointError(f"{step_dir / MANIFEST} does not list {', '.join(unlisted)}, which "
                              f"{DCP_METADATA} references (an unverified file)")


def _number(v) -> bool:
    return type(v) in (int, float) and v == v and abs(v) != float("inf")


def optimizer_fields(spec: OptimizerSpec, steps: int, state_dtype: str = "fp32") -> dict:
    """The manifest's record of the optimizer: its name, the dtype of its states and its step count (and the count
    under the spec's legacy key, for code of before `optimizer_step`)."""
    legacy = {spec.legacy_step_key: steps} if spec.legacy_step_key else {}
    return {"optimizer": spec.name, "optimizer_state_dtype": state_dtype, "optimizer_step": steps, **legacy}


def saved_optimizer(manifest: dict) -> tuple:
    """(optimizer name, step count) a manifest records: `optimizer` and `optimizer_step`, or, in a checkpoint
    written before those fields, AdamW's count under its legacy key; (None, None) when neither is there."""
    if "optimizer_step" in manifest:
        return manifest.get("optimizer"), manifest["optimizer_step"]
    if ADAMW.legacy_step_key in manifest:
        return ADAMW.name, manifest[ADAMW.legacy_step_key]
    return None, None


def saved_state_dtype(manifest: dict) -> str:
    """The dtype of a checkpoint's optimizer states: `optimizer_state_dtype`; fp32 in one written before it."""
    return manifest.get("optimizer_state_dtype", "fp32")


def check_optimizer(step_dir: Path, manifest: dict, name: str, state_dtype: str) -> Optional[str]:
    """Refuse (one line, exit 3) a checkpoint whose optimizer states this run's optimizer cannot continue: another
    optimizer's, or fp32 states into bf16 ones (each state would be rounded). bf16 states into fp32 ones are exact:
    allowed, and the note returned says so (None: nothing to note)."""
    saved, saved_dtype = saved_optimizer(manifest)[0], saved_state_dtype(manifest)
    if saved != name:
        raise CheckpointError(f"{step_dir}: its optimizer states are {saved}'s (optimizer.name = {saved!r}); this "
                              f"run's optimizer.name is {name!r}",
                              fix=f"resume with optimizer.name = {saved!r}, or set train.resume = false")
    if saved_dtype == "fp32" and state_dtype == "bf16":
        raise CheckpointError(f"{step_dir}: its {name} states are fp32; optimizer.state_dtype = 'bf16' would round "
                              "them", fix="resume with optimizer.state_dtype = 'fp32' (a bf16 checkpoint resumes into "
                              "fp32 states exactly), or set train.resume = false")
    if saved_dtype != state_dtype:
        return f"{step_dir}: its bf16 optimizer states continue as fp32 ones (exactly)"
    return None


def check_fields(step_dir: Path, manifest: dict) -> None:
    """The manifest fields resume and export use, with their types: a wrong one is a damaged checkpoint."""
    scaler = manifest.get("scaler")
    identity, layout, config = manifest.get("identity"), manifest.get("layout"), manifest.get("config")
    names = manifest.get("parameter_names")
    consumed = manifest.get("consumed_samples")
    tokenizer = manifest.get("tokenizer", {"kind": ""})  # absent in checkpoints written before it was recorded
    optimizer = saved_optimizer(manifest)
    problems = [
        (type(optimizer[0]) is str and type(optimizer[1]) is int and optimizer[1] >= 0,
         "optimizer/optimizer_step"),
        (saved_state_dtype(manifest) in ("fp32", "bf16"), "optimizer_state_dtype"),
        (type(scaler) is dict and (not scaler or (set(scaler) == {"scale", "clean_steps", "overflows_left"}
                                                  and all(_number(v) for v in scaler.values()))), "scaler"),
        (type(identity) is dict and type(identity.get("model")) is dict, "identity"),
        (type(layout) is dict, "layout"), (type(config) is dict and type(config.get("model")) is dict, "config"),
        (type(names) is dict and all(type(k) is str and type(v) is str for k, v in names.items()),
         "parameter_names"),
        (consumed is None or (type(consumed) is int and consumed >= 0), "consumed_samples"),
        (type(tokenizer) is dict and type(tokenizer.get("kind")) is str
         and all(tokenizer.get(k) is None or type(tokenizer[k]) is str for k in ("model", "merges", "eod")), "tokenizer")]
    bad = [name for ok, name in problems if not ok]
    if bad:
        raise CheckpointError(f"{step_dir / MANIFEST} is malformed: {', '.join(bad)} missing or of the wrong type")


def read_checkpoint(step_dir: Path) -> tuple[dict, object]:
    """One process (the export, tools): (manifest, DCP metadata) after every listed file is verified."""
    manifest = read_manifest(step_dir)
    problems = [p for p in (verify_file(step_dir, n, rec) for n, rec in sorted(manifest["files"].items())) if p]
    if problems:
        raise CheckpointError("; ".join(problems))
    metadata = read_dcp_metadata(step_dir)
    check_listed(step_dir, manifest, metadata)
    check_fields(step_dir, manifest)
    return manifest, metadata


# What every checkpoint written before the architecture keys (checkpointer.architecture_identity) trained: GPT-2's.
ARCHITECTURE_BEFORE_KEYS = {"position_embedding": "learned", "rope_base": None, "rope_scaling_factor": None,
                            "mlp": "gelu", "norm": "layernorm", "norm_epsilon": 1e-5, "qk_layernorm": False,
                            "bias": True}


# Llama-3.1's RoPE scaling values beside its factor (pretrain/model/rope.py), in a checkpoint's identity.
ROPE_SCALING_KEYS = ("rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                     "rope_scaling_original_max_positions")
MEGATRON_ROPE_SCALING = (1.0, 4.0, 8192)  # what megatron applied beside the factor before those keys existed


def added_architecture_keys(model: dict) -> dict:
    """The identity keys added after the architecture keys, as every checkpoint written before them trained: no
    QKV-only biases, heads of hidden / heads (head_dim None), no sliding window, megatron's fixed RoPE-scaling
    values."""
    scaled = model.get("rope_scaling_factor") is not None
    return {"qkv_bias": False, "sliding_window": None, "head_dim": None,
            **dict(zip(ROPE_SCALING_KEYS, MEGATRON_ROPE_SCALING if scaled else (None,) * 3))}


def check_identity(step_dir: Path, saved: dict, now: dict) -> None:
    """Refuse a checkpoint of another model, tokenizer or data set, naming what differs."""
    if isinstance(saved.get("model"), dict) and "mlp" not in saved["model"]:  # older than the architecture keys
        saved = dict(saved, model={**ARCHITECTURE_BEFORE_KEYS,
                                   "num_query_groups": saved["model"].get("num_attention_heads"), **saved["model"]})
    if isinstance(saved.get("model"), dict) and "qkv_bias" not in saved["model"]:  # older than the families' keys
        saved = dict(saved, model={**added_architecture_keys(saved["model"]), **saved["model"]})
    diffs = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"model.{k}: saved {a.get(k)!r}, now {b.get(k)!r}" for k in sorted(set(a) | set(b))
                      if a.get(k) != b.get(k)]
        elif a != b:
            diffs.append(f"{key}: saved {a!r}, now {b!r}")
    if diffs:
        raise CheckpointError(f"checkpoint {step_dir} was written for another model, tokenizer or data: "
                              + "; ".join(diffs) + ". Resume with the same ones, or set train.resume = false "
                              "(or another train.save_dir).")
