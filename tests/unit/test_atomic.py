"""pretrain/atomic.py, the one tmp-file-and-rename writer: a reader sees the old file or the new one, never a part."""
import os
import pickle

import pytest

from pretrain.atomic import publishing_directory, replacing, temporary_name, write_atomically
from pretrain.errors import EXIT_INPUT, DataError, InputError, TokenizerError


def test_text_and_bytes_replace_the_whole_file_and_leave_no_temporary(tmp_path):
    target = tmp_path / "status.json"
    target.write_text("old, and longer than what replaces it\n")
    assert write_atomically(target, "new\n") == target
    assert target.read_text() == "new\n"
    write_atomically(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]


def test_a_write_that_fails_leaves_the_old_file_and_removes_its_temporary(tmp_path):
    target = tmp_path / "latest"
    target.write_text("step_00000002\n")
    with pytest.raises(RuntimeError, match="disk full"):
        with replacing(target) as tmp:
            tmp.write_text("step_0000")  # half written when the writer fails
            raise RuntimeError("disk full")
    assert target.read_text() == "step_00000002\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_a_directory_of_files_is_published_whole_or_not_at_all(tmp_path):
    new = tmp_path / "out" / "export"  # none yet: the staged directory is renamed onto it
    with publishing_directory(new) as staging:
        assert staging == temporary_name(new) and staging.is_dir()
        (staging / "model.safetensors").write_bytes(b"weights")
        (staging / "config.json").write_text("{}\n")
        assert not new.exists()  # nothing of it shows before the block ends
    assert sorted(p.name for p in new.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in new.parent.iterdir()) == ["export"]
    (new / "notes.txt").write_text("kept\n")  # an existing directory: the files renamed in beside what it holds
    with publishing_directory(new) as staging:
        assert staging.parent == new
        (staging / "config.json").write_text('{"step": 2}\n')
    assert sorted(p.name for p in new.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert (new / "config.json").read_text() == '{"step": 2}\n' and (new / "notes.txt").read_text() == "kept\n"
    for target in (new, tmp_path / "never"):  # a block that fails leaves the target as it was, no staging
        with pytest.raises(RuntimeError, match="disk full"):
            with publishing_directory(target) as staging:
                (staging / "config.json").write_text("{}")
                raise RuntimeError("disk full")
    assert sorted(p.name for p in new.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_temporary_is_hidden_beside_the_target_and_per_process(tmp_path):
    assert temporary_name(tmp_path / "model.safetensors") == tmp_path / f".model.safetensors.tmp{os.getpid()}"


def test_durable_syncs_the_bytes_then_the_directory(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    target = tmp_path / "checkpoint.json"
    write_atomically(target, "{}", durable=True)
    assert synced == [str(temporary_name(target)), str(tmp_path)]
    synced.clear()
    write_atomically(target, "{}")
    assert synced == []


@pytest.mark.parametrize("kind,where,fix", [
    (DataError, "data", "fix the file, or point data.corpus / data.blend at another"),
    (TokenizerError, "tokenizer", "fix data.tokenizer_model or model.vocab_size")])
def test_data_and_tokenizer_errors_are_input_errors_with_their_default_fix(kind, where, fix):
    err = kind("corpus.jsonl:3 is not JSON")
    assert isinstance(err, InputError) and isinstance(err, ValueError) and err.exit_code == EXIT_INPUT
    assert str(err) == "corpus.jsonl:3 is not JSON"  # the message as raised; the fix is the line's
    assert err.line() == f"error: corpus.jsonl:3 is not JSON ({where}): {fix}"
    own = kind("vocab_size 100 is too small; set model.vocab_size >= 257")  # a message that brings its fix
    assert own.line() == f"error: vocab_size 100 is too small ({where}): set model.vocab_size >= 257"
    assert pickle.loads(pickle.dumps(own)).line() == own.line()  # from_rank0 broadcasts errors pickled
