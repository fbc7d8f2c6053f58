"""Checkpoints: every rank saves its own shard; a step directory appears only once complete."""
import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

LATEST = "latest"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker
    torch.set_rng_state(state["cpu"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(save_dir: Path, step: int, layout: dict, model, engine, extra: dict) -> Path:
    """Collective: all ranks call it. Writes <save_dir>/step_<N>/rank_<r>.pt, then `latest`.

    Files go into step_<N>.tmp first; rank 0 renames the directory only after every rank has
    written, so an interrupted save leaves the previous checkpoint and `latest` untouched.
    """
    rank = dist.get_rank()
    final = save_dir / f"step_{step:08d}"
    tmp = save_dir / f"step_{step:08d}.tmp"
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    dist.barrier()
    payload = {"step": step, "layout": layout, "model": model.state_dict(),
               "engine": engine.state_dict(), "rng": rng_state(), **extra}
    part = tmp / f"rank_{rank:05d}.pt"
    torch.save(payload, part.with_suffix(".pt.tmp"))
    os.replace(part.with_suffix(".pt.tmp"), part)
    dist.barrier()
    if rank == 0:
        (tmp / "meta.json").write_text(json.dumps({"step": step, "layout": layout}, indent=2))
        if final.exists():  # re-saving the same step (after a resume): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(save_dir / LATEST, final.name + "\n")
    dist.barrier()
    return final


def latest(save_dir: Path) -> Optional[Path]:
    pointer = save_dir / LATEST
    if not pointer.is_file():
        return None
    step_dir = save_dir / pointer.read_text().strip()
    if not (step_dir / "meta.json").is_file():
        raise FileNotFoundError(f"{pointer} names {step_dir}, which is missing or incomplete")
    return step_dir


def load(step_dir: Path, layout: dict, model, engine) -> dict:
    """Restore this rank's shard; refuses a checkpoint written with another layout, naming both."""
    meta = json.loads((step_dir / "meta.json").read_text())
    if meta["layout"] != layout:
        diffs = {k: (meta["layout"].get(k), layout.get(k)) for k in set(meta["layout"]) | set(layout)
                 if meta["layout"].get(k) != layout.get(k)}
        raise ValueError(f"checkpoint {step_dir} was saved with a different layout; "
                         + ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in sorted(diffs.items()))
                         + ". Resume with the saved layout, or set train.resume = false.")
    payload = torch.load(step_dir / f"rank_{dist.get_rank():05d}.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(payload["model"])
    engine.load_state_dict(payload["engine"])
    set_rng_state(payload["rng"])
    return payload
