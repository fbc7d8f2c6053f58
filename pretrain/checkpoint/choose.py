"""Which checkpoint a start resumes, chosen before the model exists: saves a crash interrupted recovered, the step
directories newest first (`latest`'s first), each verified (present, whole, unchanged files; DCP's metadata) and held to
the run's identity. The Checkpointer (checkpointer.py) then loads the one chosen into the model and engine."""
import logging
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from pretrain.checkpoint.files import CheckpointError, verify_file
from pretrain.checkpoint.read import (LATEST, check_fields, check_identity, check_listed, latest_name,
                                      read_dcp_metadata, read_manifest)
from pretrain.checkpoint.recovery import recover_interrupted, step_dirs
from pretrain.runtime.agreement import from_rank0

log = logging.getLogger("pretrain.checkpoint")


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


def find_usable(save_dir: Path, identity: dict) -> Optional[dict]:
    """Collective, before the model exists: the newest checkpoint whose files are all present, whole
    and unchanged, and written for this model, tokenizer and data; None when there is none.

    A checkpoint with a missing, truncated or altered file is skipped with a warning for the one
    before it; one written for another model, tokenizer or data is refused.
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
        return {"path": step_dir, "manifest": manifest, "notes": notes}
    if reasons:
        raise CheckpointError(f"no usable checkpoint in {save_dir}: " + " | ".join(reasons),
                              fix="repair or remove them, or set train.resume = false")
    return None
