"""Export of the docs' tiny run: an existing output is refused before loading, files honour the umask, fixed exit codes."""
import os
import stat

import pytest

from pretrain.checkpoint.export import main


def test_existing_output_file_is_refused_before_the_checkpoint_is_read(tmp_path, capsys):
    target = tmp_path / "model.safetensors"
    target.write_text("a user's file\n")
    assert main([str(tmp_path / "no-checkpoint"), str(target)]) == 2  # the output is judged first
    assert target.read_text() == "a user's file\n"
    assert "is an existing file, not a directory" in capsys.readouterr().err


def test_missing_checkpoint_is_an_input_error(tmp_path, capsys):
    assert main([str(tmp_path / "no-checkpoint"), str(tmp_path / "out")]) == 3
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664)])
def test_written_files_honour_the_umask_and_are_never_overwritten_silently(tiny_run, tmp_path, umask, mode, capsys):
    out = tmp_path / "export"
    old = os.umask(umask)
    try:
        assert main([str(tiny_run / "checkpoints"), str(out)]) == 0
        for name in ("model.safetensors", "config.json"):
            assert stat.S_IMODE((out / name).stat().st_mode) == mode, name
        (out / "notes.txt").write_text("kept\n")
        before = (out / "model.safetensors").stat().st_mtime_ns
        assert main([str(tiny_run / "checkpoints"), str(out)]) == 2
        assert "pass --overwrite" in capsys.readouterr().err
        assert (out / "model.safetensors").stat().st_mtime_ns == before
        assert main([str(tiny_run / "checkpoints"), str(out), "--overwrite"]) == 0
        assert (out / "notes.txt").read_text() == "kept\n"
    finally:
        os.umask(old)
