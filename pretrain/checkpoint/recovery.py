"""A save directory's step directories: a written save published, at start-up the saves a crash interrupted published
or removed, and the one a start resumes chosen.

A save is written into step_<N>.tmp: each rank writes and fsyncs its files (rank 0 then `pending.json`,
checkpoint.json without its file list), then, last, `written/rank_<r>.json` (their sizes and SHA-256). A .tmp whose every rank's record is there, each file at its recorded size, is complete:
publishing it only adds checkpoint.json, renames it and moves `latest` to it. The hashes are checked when it is
resumed, as for every checkpoint (`verify`).

A start chooses its checkpoint before the model exists: the step directories newest first (`latest`'s first), each
verified (present, whole, unchanged files; DCP's metadata) and held to the run's identity. The Checkpointer
(checkpointer.py) then loads the one chosen into the model and engine.
"""
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from pretrain.atomic import fsync_path, write_atomically
from pretrain.checkpoint.read import (MANIFEST, check_fields, check_identity, check_listed, check_optimizer,
                                      read_dcp_metadata, read_json, read_manifest, verify_file)
from pretrain.errors import CheckpointError
from pretrain.runtime.agreement import from_rank0

log = logging.getLogger("pretrain.checkpoint")

LATEST = "latest"  # in the save directory: the name of the newest published step directory
PENDING = "pending.json"  # in step_<N>.tmp: the manifest's fields but "files", from rank 0
WRITTEN = "written"  # in step_<N>.tmp: rank_<r>.json, each rank's files once they are on disk
TMP_STEP = re.compile(r"step_(\d{8})\.tmp")
ASIDE_STEP = re.compile(r"step_(\d{8})\.old\.tmp")


def write_json_durably(path: Path, obj) -> None:
    """JSON as the whole of `path`, atomically and durably (pretrain/atomic.py)."""
    write_atomically(path, json.dumps(obj, indent=1, sort_keys=True), durable=True)


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


def recover(save_dir: Path, keep: int) -> list[str]:
    """Collective, at start-up: a save a crash interrupted after every rank's part was written is published
    (`keep` the newest kept, as train.keep_checkpoints); an incomplete one removed. Returns the lines saying
    which (rank 0 prints them)."""
    return from_rank0(lambda: recover_interrupted(Path(save_dir), keep))


def candidates(save_dir: Path) -> list[Path]:
    """The directory `latest` names, then every other complete step directory, newest first."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    out = []
    if (save_dir / LATEST).is_file():
        try:
            out.append(save_dir / latest_name(save_dir))
        except CheckpointError as err:  # a damaged pointer: the step directories themselves, newest first
            log.warning(f"{err}; trying the complete step directories instead")
    return out + [p for p in step_dirs(save_dir) if p not in out]


def verify(step_dir: Path) -> tuple[Optional[dict], str]:
    """Collective: (manifest, '') when every file is present, whole and unchanged; else (None, why).
    Rank r checks files r, r + world, ... so each byte is read once."""
    def manifest_or_why():
        try:
            return read_manifest(step_dir), ""
        except CheckpointError as err:
            return None, str(err)
    manifest, why = from_rank0(manifest_or_why)
    if manifest is None:
        return None, why
    names = sorted(manifest["files"])
    mine = names[dist.get_rank()::dist.get_world_size()]
    problems = [p for p in (verify_file(step_dir, n, manifest["files"][n]) for n in mine) if p]
    if dist.get_rank() == 0 and not problems:
        try:  # DCP's metadata, allow-listed and validated; every file it names listed and so verified
            check_listed(step_dir, manifest, read_dcp_metadata(step_dir))
            check_fields(step_dir, manifest)
        except CheckpointError as err:
            problems.append(str(err))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    problems = [p for ps in everyone for p in ps]
    return (None, "; ".join(problems)) if problems else (manifest, "")


def find_usable(save_dir: Path, identity: dict, optimizer: Optional[tuple] = None) -> Optional[dict]:
    """Collective, before the model exists: the newest checkpoint whose files are all present, whole
    and unchanged, and written for this model, tokenizer and data; None when there is none.

    A checkpoint with a missing, truncated or altered file is skipped with a warning for the one
    before it; one written for another model, tokenizer or data is refused, and so is one whose optimizer states
    `optimizer` = (optimizer.name, optimizer.state_dtype) cannot continue (read.check_optimizer).
    """
    save_dir = Path(save_dir)
    newest_first = from_rank0(lambda: candidates(save_dir))
    notes, reasons = [], []
    for step_dir in newest_first:
        manifest, why = verify(step_dir)
        if manifest is None:
            reasons.append(why)
            notes.append(f"checkpoint {step_dir} is unusable, trying the previous one: {why}")
            if dist.get_rank() == 0:
                log.warning(notes[-1])
            continue
        check_identity(step_dir, manifest["identity"], identity)
        if optimizer is not None:
            note = check_optimizer(step_dir, manifest, *optimizer)
            notes += [note] if note else []
        return {"path": step_dir, "manifest": manifest, "notes": notes}
    if reasons:
        raise CheckpointError(f"no usable checkpoint in {save_dir}: " + " | ".join(reasons),
                              fix="repair or remove them, or set train.resume = false")
    return None
