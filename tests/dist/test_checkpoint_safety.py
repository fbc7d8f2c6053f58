"""Loading is safe: no code runs from a checkpoint, damage is named and skipped, identity is checked,
a killed save never moves `latest`, leftovers are cleaned and retention keeps the last K."""
import hashlib
import json
import os
import pickle
import shutil

import pytest

from checkpoint_harness import train_segment
from pretrain.errors import EXIT_INPUT
from ranks import run_ranks

LAYOUT = ["zero.stage=1"]  # DP 2 on 2 ranks


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """step_00000001 and step_00000002 of a 2-rank run; `latest` names step 2."""
    save_dir = tmp_path_factory.mktemp("ckpt")
    run_ranks(train_segment, 2, LAYOUT, save_dir, 0, 2, (1, 2), timeout=300)
    assert (save_dir / "latest").read_text() == "step_00000002\n"
    return save_dir


def _resume(save_dir):
    return run_ranks(train_segment, 2, LAYOUT, save_dir, 0, 0, (), True, timeout=300)[0]


def _rehash(step_dir, name):
    """Record a replaced file's size and SHA-256 in checkpoint.json, as a forger would."""
    manifest = json.loads((step_dir / "checkpoint.json").read_text())
    data = (step_dir / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step_dir / "checkpoint.json").write_text(json.dumps(manifest))


class RunsShell:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_crafted_metadata_pickle_runs_nothing(two_checkpoints, tmp_path):
    save_dir = tmp_path / "ckpt"
    shutil.copytree(two_checkpoints, save_dir)
    marker = tmp_path / "pwned"
    step2 = save_dir / "step_00000002"
    (step2 / ".metadata").write_bytes(pickle.dumps(RunsShell(f"touch {marker}")))
    _rehash(step2, ".metadata")  # the manifest agrees: only the restricted unpickler stands in the way
    out = _resume(save_dir)
    assert not marker.exists()
    assert out["resumed"]["step"] == 1
    assert out["notes"][0] == (f"checkpoint {step2} is unusable, trying the previous one: {step2}/.metadata "
                               "asks to load posix.system, which is not part of DCP's checkpoint metadata; "
                               "refusing to unpickle it")


def _truncate(path):
    path.write_bytes(path.read_bytes()[:100])


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage,name,why", [
    (_truncate, "__1_0.distcp", "has 100 bytes, the manifest records {size} (truncated or replaced)"),
    (_flip_byte, "__0_0.distcp", "does not match its SHA-256 in checkpoint.json (corrupted or tampered)"),
    (lambda p: p.unlink(), "rng/rank_00001.json", "is missing"),
    (lambda p: p.write_text('{"step": 2,'), "checkpoint.json",
     "is malformed JSON: Expecting property name enclosed in double quotes: line 1 column 12 (char 11)"),
], ids=["truncated", "tampered", "missing", "malformed_json"])
def test_damaged_checkpoint_is_named_and_the_previous_one_resumes(two_checkpoints, tmp_path, damage, name, why):
    save_dir = tmp_path / "ckpt"
    shutil.copytree(two_checkpoints, save_dir)
    path = save_dir / "step_00000002" / name
    size = path.stat().st_size
    damage(path)
    out = _resume(save_dir)
    assert out["resumed"]["step"] == 1
    assert out["notes"][0] == (f"checkpoint {save_dir / 'step_00000002'} is unusable, trying the previous one: "
                               f"{path} " + why.format(size=size))


def test_no_usable_checkpoint_is_an_error_naming_each(two_checkpoints, tmp_path):
    save_dir = tmp_path / "ckpt"
    shutil.copytree(two_checkpoints, save_dir)
    for step in (1, 2):
        (save_dir / f"step_0000000{step}" / "__0_0.distcp").unlink()
    with pytest.raises(RuntimeError, match=r"no usable checkpoint in .*step_00000002/__0_0.distcp is missing \| "
                                           r".*step_00000001/__0_0.distcp is missing; repair or remove"):
        _resume(save_dir)


@pytest.mark.parametrize("overrides,identity,diff", [
    (["model.vocab_size=120"], None, "vocab_size: saved 128, now 120"),
    ([], {"tokenizer_sha256": "another"}, "tokenizer_sha256: saved 'synthetic', now 'another'"),
], ids=["vocabulary", "tokenizer"])
def test_resume_refuses_another_vocabulary_or_tokenizer(two_checkpoints, overrides, identity, diff):
    with pytest.raises(RuntimeError, match="written for another model, tokenizer or data: " + diff):
        run_ranks(train_segment, 2, LAYOUT + overrides, two_checkpoints, 0, 0, (), True, 0, True, identity,
                  timeout=300)


def test_kill_9_during_an_async_save_leaves_latest_on_the_previous_one(tmp_path):
    save_dir = tmp_path / "ckpt"
    with pytest.raises((RuntimeError, TimeoutError)):
        run_ranks(train_segment, 2, LAYOUT, save_dir, 0, 2, (1, 2), False, 0, True, None, (2, 1), timeout=120)
    assert (save_dir / "latest").read_text() == "step_00000001\n"
    assert not (save_dir / "step_00000002").exists()
    out = run_ranks(train_segment, 2, LAYOUT, save_dir, 1, 2, (2,), True, timeout=300)[0]  # the requeued job
    assert out["resumed"]["step"] == 1
    assert (save_dir / "latest").read_text() == "step_00000002\n"
    assert not list(save_dir.glob("*.tmp"))


def test_retention_keeps_the_last_k_and_cleans_leftovers(tmp_path):
    save_dir = tmp_path / "ckpt"
    (save_dir / "step_00000009.tmp").mkdir(parents=True)  # a crashed save's leftover
    (save_dir / "step_00000009.tmp" / "__0_0.distcp").write_bytes(b"partial")
    out = run_ranks(train_segment, 1, [], save_dir, 0, 4, (1, 2, 3, 4), False, 2, False, timeout=300)[0]
    assert sorted(p.name for p in save_dir.iterdir()) == ["latest", "step_00000003", "step_00000004"]
    assert (save_dir / "latest").read_text() == "step_00000004\n"
    assert {"ckpt/stall_s", "ckpt/write_s", "ckpt/bytes"} <= set(out["reports"][-1])


def _fill(path):
    """Write zeros until the file system says it is full (ENOSPC): a real disk-full, not a simulated one."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(bytes(1 << 20))
                f.flush()
        except OSError:
            pass


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs the test can fill (tests run as root; chmod would not stop root)."""
    import subprocess
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)]).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.parametrize("case", ["async", "sync", "last_save"])
def test_a_failed_save_is_retried_and_max_failed_saves_in_a_row_stop_the_run(small_disk, case):
    """A really full disk (train.max_failed_saves = 2): save 2 fails and the run goes on, save 3 succeeds once
    there is space; then saves 4 and 5 in a row stop the run with one line, or (last_save) save 4 succeeds
    and the failure of the run's final save 5 is an error, since nothing would retry it."""
    save_dir, filler = small_disk / "ckpt", small_disk / "filler"
    fill_at = (2, 5) if case == "last_save" else (2, 4)

    def disk_full(rank, step, when, ckpt):
        if when == "before" and step in fill_at:
            ckpt.wait()  # the previous save published first (async: it completes at the next save)
            if rank == 0:
                _fill(filler)
        if when == "after" and step == 2:
            ckpt.wait()  # collective: save 2's background write fails here, on every rank
            if rank == 0:
                filler.unlink()
    last = 5 if case == "last_save" else 6
    error = "the run's last checkpoint save failed" if case == "last_save" else "2 checkpoint saves in a row failed"
    with pytest.raises(RuntimeError, match=error + r", the last: rank \d: .*No space left on device" if case !=
                       "last_save" else error + r": rank \d: .*No space left on device"):
        run_ranks(train_segment, 2, LAYOUT, save_dir, 0, last, tuple(range(1, last + 1)), False, 0, case != "sync",
                  None, None, 2, disk_full, timeout=300)
    complete = [1, 3, 4] if case == "last_save" else [1, 3]
    assert (save_dir / "latest").read_text() == f"step_0000000{complete[-1]}\n"
    assert sorted(p.name for p in save_dir.iterdir()) == ["latest"] + [f"step_0000000{s}" for s in complete]
    from pretrain.checkpoint.read import read_checkpoint
    for step in complete:
        manifest, _ = read_checkpoint(save_dir / f"step_0000000{step}")  # complete and verified
        assert manifest["step"] == step



def test_failed_saves_with_successes_between_them_do_not_stop_the_run(small_disk):
    """train.max_failed_saves = 2 counts failures in a row: saves 2 and 4 fail on a really full disk, saves 1, 3 and 5
    succeed between and after them, and the run ends normally with every successful save complete."""
    save_dir, filler = small_disk / "ckpt", small_disk / "filler"

    def disk_full_at_2_and_4(rank, step, when, ckpt):
        if step not in (2, 4):
            return
        ckpt.wait()  # before: the previous save published first (async); after: this one's write fails here
        if rank == 0:
            _fill(filler) if when == "before" else filler.unlink()
    out = run_ranks(train_segment, 2, LAYOUT, save_dir, 0, 5, (1, 2, 3, 4, 5), False, 0, True, None, None, 2,
                    disk_full_at_2_and_4, timeout=300)
    assert all(len(rank["loss"]) == 5 for rank in out)
    # the logged count after each save (an asynchronous save is published, and counted, at the next one) and at the end
    assert [report.get("ckpt/failed_saves") for report in out[0]["reports"]] == [None, 1, 1, 1, 1, 0]
    assert sorted(p.name for p in save_dir.iterdir()) == ["latest", "step_00000001", "step_00000003", "step_00000005"]
    assert (save_dir / "latest").read_text() == "step_00000005\n"

@pytest.mark.parametrize("payload", ["getattr_chain", "byte_record"])
def test_issue_23_payloads_run_nothing_on_resume_or_export(two_checkpoints, tmp_path, payload):
    """The two code paths of issue 23, checkpoint.json rewritten to match: resume falls back to step 1
    with the reason; the export refuses in one line; the payload never runs."""
    import payloads
    from pretrain.checkpoint import export
    from pretrain.checkpoint.read import read_dcp_metadata
    save_dir = tmp_path / "ckpt"
    shutil.copytree(two_checkpoints, save_dir)
    marker, step2 = tmp_path / "pwned", save_dir / "step_00000002"
    if payload == "getattr_chain":
        (step2 / ".metadata").write_bytes(payloads.getattr_chain(f"touch {marker}"))
        why = "asks to load builtins.getattr, which is not part of DCP's checkpoint metadata"
    else:
        payloads.byte_record(step2, read_dcp_metadata(step2), f"touch {marker}")
        _rehash(step2, "__0_0.distcp")
        why = "declares a byte record (BytesStorageMetadata), which DCP would read with pickle"
    _rehash(step2, ".metadata")
    out = _resume(save_dir)
    assert not marker.exists()
    assert out["resumed"]["step"] == 1
    assert out["notes"][0].startswith(f"checkpoint {step2} is unusable, trying the previous one: {step2}/.metadata")
    assert why in out["notes"][0]
    assert export.main([str(step2), str(tmp_path / "out")]) == EXIT_INPUT  # a damaged checkpoint: input error
    assert not marker.exists() and not (tmp_path / "out" / "model.safetensors").exists()


def test_a_manifest_whose_step_is_not_its_directory_is_skipped(two_checkpoints, tmp_path):
    save_dir = tmp_path / "ckpt"
    shutil.copytree(two_checkpoints, save_dir)
    step2 = save_dir / "step_00000002"
    manifest = json.loads((step2 / "checkpoint.json").read_text())
    (step2 / "checkpoint.json").write_text(json.dumps({**manifest, "step": 1}))
    out = _resume(save_dir)
    assert out["resumed"]["step"] == 1
    assert out["notes"][0] == (f"checkpoint {step2} is unusable, trying the previous one: {step2}/checkpoint.json "
                               "is malformed: its step 1 is not the step of its directory step_00000002")


def test_an_rng_file_of_valid_json_but_wrong_content_is_one_error_on_every_rank(two_checkpoints, tmp_path):
    save_dir = tmp_path / "ckpt"
    shutil.copytree(two_checkpoints, save_dir)
    step2 = save_dir / "step_00000002"
    (step2 / "rng" / "rank_00001.json").write_text('{"cpu": 5}')
    _rehash(step2, "rng/rank_00001.json")
    with pytest.raises(RuntimeError, match=r"rank_00001.json is malformed: not this rank's generator states "
                                           r"\((KeyError|TypeError): [^\n]*\); remove [^\n]*step_00000002 to resume the previous"):
        _resume(save_dir)
