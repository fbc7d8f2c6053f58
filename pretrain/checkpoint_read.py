"""The one way a checkpoint is read: DCP's .metadata unpickled from an allow-list, validated, tensors read bounded."""
import io
import os
import pickle
import pickletools
import re
from pathlib import Path, PurePosixPath

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata, _MEM_FORMAT_ENCODING)
from torch.distributed.checkpoint.planner import LoadItemType

from pretrain.checkpoint_files import MANIFEST, CheckpointError, read_json, verify_file

DCP_METADATA = ".metadata"
LATEST = "latest"
_DCP = "torch.distributed.checkpoint.metadata"
# The dataclasses a .metadata may build (NEWOBJ + BUILD): nothing else is ever instantiated.
_RECORDS = {(_DCP, "Metadata"): Metadata, (_DCP, "TensorStorageMetadata"): TensorStorageMetadata,
            (_DCP, "ChunkStorageMetadata"): ChunkStorageMetadata, (_DCP, "TensorProperties"): TensorProperties,
            (_DCP, "MetadataIndex"): MetadataIndex, (_DCP, "StorageMeta"): StorageMeta,
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo}
DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64")}


def _layout(name):
    """torch.serialization._get_layout, for the one layout DCP writes."""
    if name != "torch.strided":
        raise ValueError(f"layout {name!r} is not torch.strided")
    return torch.strided


def _mem_format(value):
    """_MEM_FORMAT_ENCODING(value): the enum member of that value, looked up by its members, never called."""
    members = {m.value: m for m in _MEM_FORMAT_ENCODING}
    if type(value) is not int or value not in members:
        raise ValueError(f"memory format encoding {value!r} is not one of {sorted(members)}")
    return members[value]


def _size(dims):
    if not isinstance(dims, (tuple, list)) or not all(type(d) is int and d >= 0 for d in dims):
        raise ValueError(f"torch.Size({dims!r}) is not a tuple of non-negative ints")
    return torch.Size(dims)


def _path(*parts):
    """StorageMeta.checkpoint_id: informative only, kept as a string."""
    if not all(isinstance(p, str) for p in parts):
        raise ValueError("checkpoint_id is not a path")
    return str(PurePosixPath(*parts))


# What a REDUCE may call (by the name the pickle gives), all of them zero3d's own checked constructors.
_CALLABLES = {("torch", "Size"): _size, ("torch.serialization", "_get_layout"): _layout,
              (_DCP, "_MEM_FORMAT_ENCODING"): _mem_format, ("pathlib", "PosixPath"): _path}
_VALUES = {("torch", name): dtype for name, dtype in DTYPES.items()}
_OPCODES = {  # data-only opcodes plus the three that build the allowed objects (REDUCE, NEWOBJ, BUILD)
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "INT", "BININT", "BININT1", "BININT2", "LONG",
    "LONG1", "LONG4", "FLOAT", "BINFLOAT", "STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE",
    "SHORT_BINUNICODE", "BINUNICODE8", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "NONE", "NEWTRUE",
    "NEWFALSE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE", "LIST", "EMPTY_LIST", "APPEND",
    "APPENDS", "DICT", "EMPTY_DICT", "SETITEM", "SETITEMS", "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT",
    "LONG_BINPUT", "MEMOIZE", "GLOBAL", "STACK_GLOBAL", "REDUCE", "NEWOBJ", "BUILD"}


_NONE = type(None)
_FIELD_TYPES = {  # what BUILD may put in each field: flat values, so no shared-reference graph reaches a hash
    Metadata: {"state_dict_metadata": (dict,), "planner_data": (dict, _NONE), "storage_data": (dict, _NONE),
               "storage_meta": (StorageMeta, _NONE), "version": (str, _NONE)},
    TensorStorageMetadata: {"properties": (TensorProperties,), "size": (torch.Size,), "chunks": (list,)},
    ChunkStorageMetadata: {"offsets": (torch.Size,), "sizes": (torch.Size,)},
    MetadataIndex: {"fqn": (str,), "offset": (torch.Size, _NONE), "index": (int, _NONE)},
    StorageMeta: {"checkpoint_id": (str, _NONE), "save_id": (str, _NONE), "load_id": (str, _NONE),
                  "modules": (list,)},
    _StorageInfo: {"relative_path": (str,), "offset": (int,), "length": (int,),
                   "transform_descriptors": (list, tuple, _NONE)}}
MAX_TUPLE_DEPTH = 2  # torch.Size's REDUCE arguments, ((d0, d1, ...),), are the deepest DCP writes


class _MetadataUnpickler(pickle._Unpickler):
    """Python's unpickler with an allow-list of opcodes and names: REDUCE calls only _CALLABLES, NEWOBJ
    creates only _RECORDS, BUILD fills only their instances' declared fields; anything else is refused."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, data: bytes, source: Path):
        super().__init__(io.BytesIO(data))
        self.source = source
        self.depths: dict = {}  # id(tuple) -> (tuple, depth), for the tuples this file built

    def tuple_of(self, items) -> tuple:
        """A tuple, refused when nested deeper than MAX_TUPLE_DEPTH (shared references could otherwise make
        hashing or printing it exponential in the file's size)."""
        t = tuple(items)
        depth = 1 + max((self.depths.get(id(x), (None, 1))[1] for x in t if type(x) is tuple), default=0)
        if depth > MAX_TUPLE_DEPTH:
            self.refuse(f"nest tuples {depth} deep")
        self.depths[id(t)] = (t, depth)
        return t

    def load_tuple(self):
        items = self.pop_mark()  # before self.append: pop_mark switches the stack
        self.append(self.tuple_of(items))

    def load_tuple1(self):
        self.stack[-1] = self.tuple_of(self.stack[-1:])

    def load_tuple2(self):
        self.stack[-2:] = [self.tuple_of(self.stack[-2:])]

    def load_tuple3(self):
        self.stack[-3:] = [self.tuple_of(self.stack[-3:])]

    def refuse(self, what: str):
        raise CheckpointError(f"{self.source} asks to {what}, which is not part of DCP's checkpoint metadata; "
                              "refusing to unpickle it")

    def find_class(self, module, name):
        key = (module, name)
        found = _RECORDS.get(key) or _CALLABLES.get(key) or _VALUES.get(key)
        if key == (_DCP, "BytesStorageMetadata"):
            raise CheckpointError(f"{self.source} declares a byte record (BytesStorageMetadata), which DCP would "
                                  "read with pickle; only tensor records are accepted (zero3d writes no other)")
        if found is None:
            self.refuse(f"load {module}.{name}")
        return found

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if not any(func is f for f in _CALLABLES.values()) or type(args) is not tuple:
            self.refuse(f"call {getattr(func, '__name__', type(func).__name__)}")
        self.stack[-1] = func(*args)

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        if not any(cls is c for c in _RECORDS.values()) or args != ():
            self.refuse(f"create {getattr(cls, '__name__', type(cls).__name__)}")
        self.append(cls.__new__(cls))

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if not any(type(inst) is c for c in _RECORDS.values()):
            self.refuse(f"set the state of {type(inst).__name__}")
        if type(inst) is TensorProperties:
            if (type(state) is not tuple or len(state) != 5 or not any(state[0] is d for d in DTYPES.values())
                    or state[1] is not torch.strided or type(state[3]) is not _MEM_FORMAT_ENCODING
                    or any(type(state[i]) is not bool for i in (2, 4))):
                self.refuse("set TensorProperties from something other than (float dtype, torch.strided, bool, "
                            "memory format, bool)")
            inst.__setstate__(state)
            return
        fields = _FIELD_TYPES[type(inst)]
        if type(state) is not dict or not all(type(k) is str and k in fields for k in state):
            self.refuse(f"set fields other than {sorted(fields)} of {type(inst).__name__}")
        for key, value in state.items():
            if type(value) not in fields[key]:
                self.refuse(f"set {type(inst).__name__}.{key} to a {type(value).__name__}")
        inst.__dict__.update(state)

    dispatch[pickle.TUPLE[0]] = load_tuple
    dispatch[pickle.TUPLE1[0]] = load_tuple1
    dispatch[pickle.TUPLE2[0]] = load_tuple2
    dispatch[pickle.TUPLE3[0]] = load_tuple3

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.BUILD[0]] = load_build


def _refuse_opcode(name: str):
    return lambda self: self.refuse(f"use the pickle opcode {name}")


def _invalid_opcode(code: int):
    def invalid(self):
        raise pickle.UnpicklingError(f"invalid load key, {chr(code)!r}")
    return invalid


_NAMES = {ord(op.code): op.name for op in pickletools.opcodes}
for _code in range(256):
    if _code not in _NAMES:
        _MetadataUnpickler.dispatch[_code] = _invalid_opcode(_code)
    elif _NAMES[_code] not in _OPCODES:
        _MetadataUnpickler.dispatch[_code] = _refuse_opcode(_NAMES[_code])


def _unpickle(path: Path):
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read: {err}") from None
    try:
        return _MetadataUnpickler(data, path).load()
    except CheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - any unpickling failure is a malformed file
        raise CheckpointError(f"{path} is malformed: {type(err).__name__}: {str(err)[:200]}") from None


_SHARD_NAME = re.compile(r"__\d+_\d+\.distcp")


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
    md = _unpickle(step_dir / DCP_METADATA)
    validate_metadata(md, step_dir)
    return md


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
            if type(tensor) is not torch.Tensor or tensor.dtype != target.dtype:
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


def check_fields(step_dir: Path, manifest: dict) -> None:
    """The manifest fields resume and export use, with their types: a wrong one is a damaged checkpoint."""
    scaler = manifest.get("scaler")
    identity, layout, config = manifest.get("identity"), manifest.get("layout"), manifest.get("config")
    names = manifest.get("parameter_names")
    consumed = manifest.get("consumed_samples")
    problems = [
        (type(manifest.get("adam_step")) is int and manifest["adam_step"] >= 0, "adam_step"),
        (type(scaler) is dict and (not scaler or (set(scaler) == {"scale", "clean_steps", "overflows_left"}
                                                  and all(_number(v) for v in scaler.values()))), "scaler"),
        (type(identity) is dict and type(identity.get("model")) is dict, "identity"),
        (type(layout) is dict, "layout"), (type(config) is dict and type(config.get("model")) is dict, "config"),
        (type(names) is dict and all(type(k) is str and type(v) is str for k, v in names.items()),
         "parameter_names"),
        (consumed is None or (type(consumed) is int and consumed >= 0), "consumed_samples")]
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


def check_identity(step_dir: Path, saved: dict, now: dict) -> None:
    """Refuse a checkpoint of another model, tokenizer or data set, naming what differs."""
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


def latest_name(save_dir: Path) -> str:
    """The step directory `<save_dir>/latest` names (step_<8 digits>), or a CheckpointError saying what it holds."""
    path = save_dir / LATEST
    try:
        text = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read: {err.strerror}") from None
    name = text.decode("latin-1").strip()
    if re.fullmatch(r"step_\d{8}", name) is None:
        raise CheckpointError(f"{path} holds {text[:40]!r}, not the name of a step directory (step_<8 digits>)")
    return name
