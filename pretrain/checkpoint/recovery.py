"""Publishing a written save (checkpoint.json, rename, `latest`), and at start-up the saves a crash interrupted.

A save is written into step_<N>.tmp: each rank writes and fsyncs its files (rank 0 then `pending.json`,
checkpoint.json without its file list), then, last, `written/rank_<r>.json` (their sizes and SHA-256). A .tmp whose every rank's record is there, each file at its recorded size, is complete:
publishing it only adds checkpoint.json and renames it. The hashes are checked when it is resumed, as for
every checkpoint (choose.verify).
"""
import re
import shutil
from pathlib import Path
from typing import Optional

from pretrain.atomic import fsync_path, write_atomically
from pretrain.checkpoint.files import MANIFEST, CheckpointError, read_json, write_json_durably
from pretrain.checkpoint.read import LATEST, latest_name

PENDING = "pending.json"  # in step_<N>.tmp: the manifest's fields but "files", from rank 0
WRITTEN = "written"  # in step_<N>.tmp: rank_<r>.json, each rank's files once they are on disk
TMP_STEP = re.compile(r"step_(\d{8})\.tmp")
ASIDE_STEP = re.compile(r"step_(\d{8})\.old\.tmp")


def step_dirs(save_dir: Path) -> list[Path]:
    """Complete step directories, newest first."""
    return sorted((p for p in save_dir.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")),
                  key=lambda p: p.name, reverse=True)


def written_record(tmp: Path, rank: int, files: dict) -> None:
    """A rank's last act in a save: its files' records, durably (their presence marks its part complete)."""
    (tmp / WRITTEN).mkdir(exist_ok=True)
    write_json_durably(tmp / WRITTEN / f"rank_{rank:05d}.json", {"rank": rank, "files": files})


def publish_step_dir(tmp: Path, final: Path, manifest: dict, keep: int) -> None:
    """checkpoint.json into `tmp`, the save's bookkeeping removed, `tmp` renamed to `final`, `latest`
    moved to it, checkpoints beyond the `keep` newest pruned (0 keeps all)."""
    save_dir = final.parent
    write_json_durably(tmp / MANIFEST, manifest)  # from here on the .tmp is complete by its manifest alone
    (tmp / PENDING).unlink(missing_ok=True)
    shutil.rmtree(tmp / WRITTEN, ignore_errors=True)
    fsync_path(tmp / "rng")
    fsync_path(tmp)
    aside = None
    if final.exists():  # the same step saved again (after a resume): replace it whole
        aside = final.with_name(final.name + ".old.tmp")
        final.rename(aside)
    tmp.rename(final)
    fsync_path(save_dir)
    write_atomically(save_dir / LATEST, final.name + "\n", durable=True)
    if aside is not None:
        shutil.rmtree(aside)
    if keep > 0:
        for old in step_dirs(save_dir)[keep:]:
            if old != final:  # `latest` names the newest; never removed
                shutil.rmtree(old)


def complete_manifest(tmp: Path) -> tuple[Optional[dict], str]:
    """(manifest, '') when every rank's part of the save in `tmp` is on disk, else (None, what is missing)."""
    try:
        if (tmp / MANIFEST).is_file():  # the publish itself was interrupted
            manifest = read_json(tmp / MANIFEST)
        else:
            manifest = read_json(tmp / PENDING)
            world = manifest.get("layout", {}).get("world_size") if isinstance(manifest.get("layout"), dict) else None
            if type(world) is not int or world < 1:
                return None, f"{tmp / PENDING} names no world size"
            files = {}
            for rank in range(world):
                record = tmp / WRITTEN / f"rank_{rank:05d}.json"
                if not record.is_file():
                    return None, f"rank {rank}'s part was not finished ({WRITTEN}/{record.name} is missing)"
                part = read_json(record).get("files")
                if not isinstance(part, dict):
                    return None, f"{record} lists no files"
                files.update(part)
            manifest = {**manifest, "files": files}
    except CheckpointError as err:
        return None, str(err)
    for name, rec in manifest.get("files", {}).items():
        path = tmp / name
        if not isinstance(rec, dict) or not path.is_file() or path.stat().st_size != rec.get("bytes"):
            return None, f"{name} is missing or not at its recorded size"
    return manifest, ""


def _latest_step(save_dir: Path) -> int:
    """The step `latest` names (else the newest complete step directory); -1 when there is none."""
    try:
        return int(latest_name(save_dir)[5:])
    except CheckpointError:
        newest = step_dirs(save_dir)[:1]
        return int(newest[0].name[5:]) if newest else -1


def recover_interrupted(save_dir: Path, keep: int) -> list[str]:
    """Rank 0 at start-up: the saves a crash left as .tmp directories, each published (complete and newer
    than `latest`) or removed; a checkpoint moved aside by an interrupted re-publish of its step restored.
    Returns one line per directory acted on."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    lines = []
    for aside in sorted(p for p in save_dir.iterdir() if ASIDE_STEP.fullmatch(p.name)):
        final = save_dir / aside.name[:-len(".old.tmp")]
        if final.exists():
            shutil.rmtree(aside)
        else:  # the crash came between moving it aside and renaming its replacement in
            aside.rename(final)
            fsync_path(save_dir)
            lines.append(f"restored {final.name} from {aside.name} (its replacement was interrupted)")
    latest = _latest_step(save_dir)
    for tmp in sorted((p for p in save_dir.iterdir() if TMP_STEP.fullmatch(p.name) and p.is_dir()), reverse=True):
        step = int(tmp.name[5:13])
        manifest, why = complete_manifest(tmp)
        if manifest is not None and step > latest:
            publish_step_dir(tmp, save_dir / tmp.name[:-4], manifest, keep)
            latest = step
            lines.append(f"published {tmp.name[:-4]} from {tmp.name}: a save every rank had finished writing "
                         "before the run was interrupted")
            continue
        shutil.rmtree(tmp)
        why = why or f"not newer than the latest checkpoint (step {latest})"
        lines.append(f"removed {tmp.name}: an interrupted save that cannot be resumed: {why}")
    newest = [d for d in step_dirs(save_dir) if (d / MANIFEST).is_file()][:1]
    if newest and int(newest[0].name[5:]) > latest:  # renamed into place, `latest` not yet moved
        write_atomically(save_dir / LATEST, newest[0].name + "\n", durable=True)
        lines.append(f"moved latest to {newest[0].name}: its publication was interrupted before `latest` named it")
    return lines
