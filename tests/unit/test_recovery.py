"""Start-up recovery of the two publication steps a crash can split: the rename done but `latest` not moved,
and a checkpoint moved aside for its replacement that never arrived."""
from pretrain.checkpoint.recovery import recover_interrupted


def step(save_dir, n: int, suffix: str = ""):
    d = save_dir / f"step_{n:08d}{suffix}"
    d.mkdir(parents=True)
    (d / "checkpoint.json").write_text('{"step": %d}' % n)
    return d


def test_latest_moved_to_a_directory_renamed_into_place(tmp_path):
    step(tmp_path, 2)
    step(tmp_path, 4)
    (tmp_path / "latest").write_text("step_00000002\n")
    assert recover_interrupted(tmp_path, keep=0) == [
        "moved latest to step_00000004: its publication was interrupted before `latest` named it"]
    assert (tmp_path / "latest").read_text() == "step_00000004\n"
    assert recover_interrupted(tmp_path, keep=0) == []  # nothing left to do


def test_a_checkpoint_set_aside_is_restored_when_its_replacement_never_arrived(tmp_path):
    step(tmp_path, 4, ".old.tmp")
    (tmp_path / "latest").write_text("step_00000004\n")
    assert recover_interrupted(tmp_path, keep=0) == [
        "restored step_00000004 from step_00000004.old.tmp (its replacement was interrupted)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000004"]
    assert (tmp_path / "step_00000004" / "checkpoint.json").read_text() == '{"step": 4}'
