"""Any bytes in a checkpoint's .metadata, shards or manifest: no code runs, a one-line CheckpointError or a load."""
import copy
import hashlib
import json
import os
import pickle
import random
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from pretrain.errors import CheckpointError
from pretrain.checkpoint.read import FORMAT, read_dcp_metadata
from pretrain.checkpoint.export import read_model_tensors

STEP = "step_00000003"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real DCP checkpoint of three tensors with its manifest, as zero3d lays one out."""
    step_dir = tmp_path_factory.mktemp("fuzz") / STEP
    g = torch.Generator().manual_seed(0)
    state = {"model/w": torch.randn(4, 6, generator=g), "model/b": torch.randn(6, generator=g),
             "optim/master/w": torch.randn(4, 6, generator=g)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=step_dir, no_dist=True)
    manifest = {"format": FORMAT, "step": 3, "files": {}, "adam_step": 3, "scaler": {}, "consumed_samples": 36,
                "identity": {"model": {}}, "layout": {}, "config": {"model": {}}, "parameter_names": {"w": "w"}}
    for name in (".metadata", "__0_0.distcp"):
        _record(step_dir, manifest, name)
    return step_dir, state


def _record(step_dir, manifest, name):
    data = (step_dir / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step_dir / "checkpoint.json").write_text(json.dumps(manifest))


def _rehash(step_dir):
    """The forger's move: checkpoint.json rewritten to match whatever the files now are."""
    manifest = json.loads((step_dir / "checkpoint.json").read_text())
    for name in list(manifest["files"]):
        if (step_dir / name).is_file():
            _record(step_dir, manifest, name)


from payloads import CALL, G, P, S, Shell, byte_record, getattr_chain  # noqa: E402


def _metadata_pickles(md, cmd):
    """Valid pickles of wrong content: (name, bytes)."""
    out = [("plain dict", pickle.dumps({"state_dict_metadata": {}})), ("list", pickle.dumps([1, 2])),
           ("None", pickle.dumps(None)), ("int", pickle.dumps(7)), ("os.system", pickle.dumps(Shell(cmd))),
           ("os.system in a dict", pickle.dumps({"x": Shell(cmd)})), ("getattr chain", getattr_chain(cmd)),
           ("eval", P(CALL(G("builtins", "eval"), S(f"__import__('os').system({cmd!r})")))),
           ("copyreg._reconstructor", P(CALL(G("copyreg", "_reconstructor"), G("os", "system"),
                                             G("builtins", "object"), S(cmd)))),
           ("torch rebuild", P(CALL(G("torch._utils", "_rebuild_tensor_v2"), S("x")))),
           ("Size called with a shell", P(CALL(G("torch", "Size"), pickle.dumps(Shell(cmd))[2:-1]))),
           ("layout name", P(CALL(G("torch.serialization", "_get_layout"), S("os.system")))),
           ("enum by value", P(CALL(G("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
                                    S("system")))),
           ("NEWOBJ of a callable", P(G("os", "system") + b")\x81")),
           ("NEWOBJ of torch.Size", P(G("torch", "Size") + b")\x81")),
           ("BUILD on a class", P(G("torch.distributed.checkpoint.metadata", "Metadata")
                                  + b"}" + S("__eq__") + G("os", "system") + b"sb")),
           ("PERSID", b"\x80\x02P" + cmd.encode() + b"\n."), ("EXT1", b"\x80\x02\x82\x01."),
           ("OBJ", P(b"(" + G("os", "system") + S(cmd) + b"o")),
           ("INST", b"(S'" + cmd.encode() + b"'\nios\nsystem\n."),
           ("empty Metadata", P(G("torch.distributed.checkpoint.metadata", "Metadata") + b")\x81")),
           # t(i+1) = (t(i), t(i)) through the memo, as a dict key: hashing it takes 2**24 steps
           ("shared-tuple hash bomb", b"\x80\x04}K\x00K\x00\x86q\x00" + b"".join(
               b"0h%ch%c\x86q%c" % (i, i, i + 1) for i in range(24)) + b"K\x01s.")]

    def variant(name, change):
        m = copy.deepcopy(md)
        change(m)
        out.append((name, pickle.dumps(m)))

    key = next(iter(md.storage_data))
    first = md.storage_data[key]

    def set_info(**kw):
        def change(m):
            for k, v in kw.items():
                setattr(m.storage_data[key], k, v)
        return change

    for name, kw in [("huge offset", {"offset": 1 << 62}), ("negative offset", {"offset": -1}),
                     ("huge length", {"length": 1 << 40}), ("zero length", {"length": 0}),
                     ("offset a float", {"offset": 1.0}), ("offset a string", {"offset": "0"}),
                     ("offset a bool", {"offset": True}), ("past the end", {"offset": first.length + 10**6}),
                     ("path ../", {"relative_path": "../" + first.relative_path}),
                     ("absolute path", {"relative_path": "/etc/passwd"}),
                     ("path with a separator", {"relative_path": "rng/rank_00000.json"}),
                     ("path .metadata", {"relative_path": ".metadata"}), ("path None", {"relative_path": None}),
                     ("transforms", {"transform_descriptors": ["zstd"]})]:
        variant(name, set_info(**kw))
    fqn = key.fqn
    variant("byte record", lambda m: m.state_dict_metadata.__setitem__(fqn, BytesStorageMetadata()))
    variant("record a dict", lambda m: m.state_dict_metadata.__setitem__(fqn, {}))
    variant("state_dict_metadata None", lambda m: setattr(m, "state_dict_metadata", None))
    variant("storage_data None", lambda m: setattr(m, "storage_data", None))
    variant("storage_data a list", lambda m: setattr(m, "storage_data", list(m.storage_data.values())))
    variant("storage entry missing", lambda m: m.storage_data.pop(key))
    variant("storage entry of no record", lambda m: m.storage_data.__setitem__(
        MetadataIndex("model/ghost", (0,)), m.storage_data[key]))
    variant("size negative", lambda m: setattr(m.state_dict_metadata[fqn], "size", torch.Size([-4, 6])))
    variant("size smaller than its chunk", lambda m: setattr(m.state_dict_metadata[fqn], "size", torch.Size([1, 1])))
    variant("size a list", lambda m: setattr(m.state_dict_metadata[fqn], "size", [4, 6]))
    variant("chunk offset out of shape", lambda m: setattr(m.state_dict_metadata[fqn].chunks[0], "offsets",
                                                           torch.Size([9] * len(m.state_dict_metadata[fqn].size))))
    variant("chunk of other rank", lambda m: setattr(m.state_dict_metadata[fqn].chunks[0], "sizes", torch.Size([1])))
    variant("chunks None", lambda m: setattr(m.state_dict_metadata[fqn], "chunks", None))
    variant("dtype int64", lambda m: setattr(m.state_dict_metadata[fqn].properties, "dtype", torch.int64))
    variant("dtype a string", lambda m: setattr(m.state_dict_metadata[fqn].properties, "dtype", "float32"))
    variant("record key an int", lambda m: m.state_dict_metadata.__setitem__(5, m.state_dict_metadata.pop(fqn)))
    variant("planner_data a list", lambda m: setattr(m, "planner_data", [1]))
    return out


def _outcome(step_dir, sentinel):
    """'ok' or the CheckpointError's line; anything else (another exception type) fails the test."""
    try:
        read_model_tensors(step_dir)
        result = "ok"
    except CheckpointError as err:
        result = str(err)
        assert "\n" not in result and result, result
    assert not sentinel.exists(), "a payload ran"
    return result


def _cases(md, cmd):
    """(name, damage(step_dir), rehash) for >= 200 mutations, seeded so each is reproducible."""
    rng = random.Random(23)
    cases = []
    for i in range(25):
        n = rng.choice([0, 1, 16, 200, 5000])
        cases.append((f"metadata random {n} bytes #{i}", lambda d, n=n, s=rng.random(): (d / ".metadata").write_bytes(
            random.Random(s).randbytes(n)), rng.random() < 0.8))
    for i in range(70):
        cases.append((f"metadata bit flip #{i}", lambda d, s=rng.random(): _flip(d / ".metadata", s), True))
    for i in range(20):
        cases.append((f"metadata truncated #{i}", lambda d, s=rng.random(): _cut(d / ".metadata", s), True))
    for i in range(30):
        cases.append((f"shard bit flip #{i}", lambda d, s=rng.random(): _flip(d / "__0_0.distcp", s), True))
    for i in range(15):
        cases.append((f"shard truncated #{i}", lambda d, s=rng.random(): _cut(d / "__0_0.distcp", s), True))
    cases.append(("shard random bytes", lambda d: (d / "__0_0.distcp").write_bytes(rng.randbytes(3000)), True))
    cases.append(("shard a torch pickle payload", lambda d: _shard_payload(d, cmd), True))
    for name, data in _metadata_pickles(md, cmd):
        cases.append((f"metadata: {name}", lambda d, data=data: (d / ".metadata").write_bytes(data), True))
    for name, change in _manifest_changes():
        cases.append((f"manifest: {name}", lambda d, c=change: _edit_manifest(d, c), False))
    return cases


def _flip(path, seed):
    data = bytearray(path.read_bytes())
    r = random.Random(seed)
    data[r.randrange(len(data))] ^= 1 << r.randrange(8)
    path.write_bytes(bytes(data))


def _cut(path, seed):
    data = path.read_bytes()
    path.write_bytes(data[:random.Random(seed).randrange(len(data))])


def _shard_payload(step_dir, cmd):
    """A shard whose every record is a pickle that would run a command if loaded without weights_only."""
    path = step_dir / "__0_0.distcp"
    size = path.stat().st_size
    blob = pickle.dumps(Shell(cmd))
    path.write_bytes((blob * (size // len(blob) + 1))[:size])


def _manifest_changes():
    return [("step of another directory", lambda m: m.update(step=18)), ("step a string", lambda m: m.update(step="3")),
            ("no files", lambda m: m.update(files={})),
            ("shard not listed", lambda m: m["files"].pop("__0_0.distcp")),
            ("metadata not listed", lambda m: m["files"].pop(".metadata")),
            ("a ../ name", lambda m: m["files"].update({"../x": {"bytes": 1, "sha256": "0"}})),
            ("a record a list", lambda m: m["files"].update({"__0_0.distcp": [1]})),
            ("bytes a string", lambda m: m["files"]["__0_0.distcp"].update(bytes="7")),
            ("format another", lambda m: m.update(format="other")), ("files a list", lambda m: m.update(files=[])),
            ("no identity", lambda m: m.pop("identity")), ("adam_step negative", lambda m: m.update(adam_step=-1)),
            ("scaler of strings", lambda m: m.update(scaler={"scale": "x", "clean_steps": 0, "overflows_left": 1})),
            ("parameter names a list", lambda m: m.update(parameter_names=[])),
            ("config without model", lambda m: m.update(config={}))]


def _edit_manifest(step_dir, change):
    manifest = json.loads((step_dir / "checkpoint.json").read_text())
    change(manifest)
    (step_dir / "checkpoint.json").write_text(json.dumps(manifest))


def test_fuzzed_checkpoints_run_no_code_and_fail_in_one_line(checkpoint, tmp_path):
    base, state = checkpoint
    sentinel = tmp_path / "payload_ran"
    md = read_dcp_metadata(base)
    cases = _cases(md, f"touch {sentinel}")
    assert len(cases) >= 200
    outcomes = {}
    for name, damage, rehash in cases:
        step_dir = tmp_path / "c" / STEP
        shutil.rmtree(step_dir.parent, ignore_errors=True)
        shutil.copytree(base, step_dir)
        damage(step_dir)
        if rehash:
            _rehash(step_dir)
        outcomes[name] = _outcome(step_dir, sentinel)
    refused = {n: o for n, o in outcomes.items() if o != "ok"}
    # every crafted pickle and every manifest inconsistency is refused, whatever the manifest says
    for name in outcomes:
        if name.startswith(("metadata: ", "manifest: ", "shard a torch", "shard random", "metadata random")):
            assert name in refused, f"{name} was accepted"
    assert "asks to load posix.system" in refused["metadata: os.system"]
    assert "asks to nest tuples 3 deep" in refused["metadata: shared-tuple hash bomb"]
    assert "asks to load builtins.getattr" in refused["metadata: getattr chain"]
    assert "only tensor records are accepted" in refused["metadata: byte record"]
    assert "not a __<r>_<n>.distcp file" in refused["metadata: path ../"]
    assert "which has" in refused["metadata: past the end"]
    assert f"its step 18 is not the step of its directory {STEP}" in refused["manifest: step of another directory"]
    assert "does not list __0_0.distcp" in refused["manifest: shard not listed"]
    assert "does not list .metadata, __0_0.distcp, which .metadata references" in refused["manifest: no files"]
    if os.environ.get("ZERO3D_FUZZ_REPORT"):
        with open(os.environ["ZERO3D_FUZZ_REPORT"], "w") as f:
            json.dump(outcomes, f, indent=1)


def test_an_unchanged_checkpoint_loads_its_tensors(checkpoint):
    step_dir, state = checkpoint
    manifest, tensors = read_model_tensors(step_dir)
    assert manifest["step"] == 3
    assert set(tensors) == {"w", "b"}
    assert torch.equal(tensors["w"], state["model/w"]) and torch.equal(tensors["b"], state["model/b"])


def test_latest_with_a_nul_byte_and_a_bogus_wandb_mode_are_one_line_errors(tmp_path, checkpoint):
    from pretrain.checkpoint.recovery import candidates, latest_name
    from pretrain.errors import EXIT_INPUT, InputError
    from pretrain.metrics import wandb_mode
    (tmp_path / "step_00000001").mkdir()
    (tmp_path / "latest").write_bytes(b"step_0000\x000002\n")
    with pytest.raises(CheckpointError, match=r"latest holds b'step_0000\\x000002\\n', not the name of a step"):
        latest_name(tmp_path)
    assert candidates(tmp_path) == [tmp_path / "step_00000001"]  # the pointer ignored, warned
    with pytest.raises(InputError) as err:
        wandb_mode({"WANDB_MODE": "bogus"})
    assert err.value.exit_code == EXIT_INPUT and err.value.line() == (
        "error: WANDB_MODE = 'bogus' is invalid (environment): set it to one of online, offline, disabled, "
        "dryrun, shared, run, or unset it, or set logging.wandb=false")
