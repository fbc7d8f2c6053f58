"""Resume checks: the checkpoint `latest` names, validated on rank 0 before the model is built; agreed loading."""
import json
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from pretrain import checkpoint
from pretrain.errors import InputError


def check_resume(save_dir: Path, layout: dict, world_size: int) -> Optional[Path]:
    """Rank 0, before the model is built: the checkpoint `latest` names, complete and of this layout."""
    where, fix = "checkpoint", "repair or remove it, or set train.resume = false to start over"
    if save_dir.exists() and not save_dir.is_dir():
        raise InputError(f"checkpoint directory {str(save_dir)!r} is a file", where, "set train.save_dir to a directory")
    pointer = save_dir / checkpoint.LATEST
    if not pointer.is_file():
        return None
    step_dir = save_dir / pointer.read_text().strip()
    try:
        meta = json.loads((step_dir / "meta.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{pointer} names {step_dir}, whose meta.json is missing or unreadable "
                         f"({type(err).__name__})", where, fix) from None
    saved = meta.get("layout") if isinstance(meta, dict) else None
    if saved != layout:
        saved = saved if isinstance(saved, dict) else {}
        diffs = sorted(k for k in set(saved) | set(layout) if saved.get(k) != layout.get(k))
        raise InputError(f"checkpoint {step_dir} was saved with a different layout", where,
                         ", ".join(f"{k}: saved {saved.get(k)!r}, now {layout.get(k)!r}" for k in diffs)
                         + ": resume with the saved layout, or set train.resume = false")
    missing = [r for r in range(world_size) if not (step_dir / f"rank_{r:05d}.pt").is_file()]
    if missing:
        raise InputError(f"checkpoint {step_dir} has no shard for rank(s) {missing}", where, fix)
    return step_dir


def load_checkpoint_agreed(step_dir: Path, layout: dict, model, engine, topo) -> int:
    """Every rank loads its shard; an unreadable shard on any rank stops every rank, naming it."""
    failed, message = False, ""
    try:
        start = checkpoint.load(step_dir, layout, model, engine)["step"]
    except Exception as err:  # noqa: BLE001 - agreed below, raised on every rank
        failed, message, start = True, f"{type(err).__name__}: {err}".splitlines()[0], 0
    flags = [torch.zeros(1, device=topo.device) for _ in range(topo.world_size)]
    dist.all_gather(flags, torch.tensor([float(failed)], device=topo.device))
    bad = [r for r, f in enumerate(flags) if f.item()]
    if bad:
        raise InputError(f"checkpoint {step_dir} could not be loaded on rank(s) {bad}"
                         + (f" ({message})" if failed else ""), "checkpoint",
                         "repair or remove that step directory, or set train.resume = false")
    return start
