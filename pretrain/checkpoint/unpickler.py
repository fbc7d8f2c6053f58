"""DCP's .metadata pickle read from an allow-list: only DCP's record classes and checked constructors, no callable."""
import io
import pickle
import pickletools
from pathlib import Path, PurePosixPath

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata, _MEM_FORMAT_ENCODING)

from pretrain.errors import CheckpointError

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


def unpickle_metadata(path: Path):
    """The object a .metadata file holds, built only from the allow-list; any other content is a CheckpointError."""
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

