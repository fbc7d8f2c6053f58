"""A config's paths as a pyxis container will see them (slurm/launch.sbatch: the repository mounted at its own path, the
working directory, plus ZERO3D_CONTAINER_MOUNTS): each path the run reads or writes must lie inside a mount, and is
checked on the submitting host at the mount's source, not at its own name (which the host may have, or lack, apart)."""
import dataclasses
import glob
import os
from pathlib import Path
from typing import Optional

from pretrain.config import Config

MOUNTS_VARIABLE = "ZERO3D_CONTAINER_MOUNTS"
# the keys naming files or directories a rank reads or writes; the blends' prefixes are read too
PATH_KEYS = (("data", "corpus"), ("data", "tokenizer_model"), ("data", "tokenizer_merges"), ("data", "cache_dir"),
             ("logging", "run_dir"), ("train", "save_dir"), ("train", "init_from"), ("train", "save_final_hf"))


def parse_mounts(repo: Path, extra: str) -> list[tuple[str, str]]:
    """(host source, container destination) of every mount: the repository at its own path, then pyxis's
    `SRC[:DST[:FLAGS]]` items of `extra` (a missing DST is SRC)."""
    pairs = [(str(repo), str(repo))]
    for item in (part.strip() for part in extra.split(",")):
        if item:
            src, _, rest = item.partition(":")
            dst = rest.partition(":")[0] or src
            pairs.append((os.path.normpath(src), os.path.normpath(dst)))
    return pairs


def host_path(path: str, mounts: list[tuple[str, str]], workdir: Path) -> Optional[str]:
    """Where `path` (as a rank in the container names it, relative to `workdir`) lies on the host: the longest mount
    destination holding it, its source in its place; None when no mount holds it."""
    inside = os.path.normpath(path if os.path.isabs(path) else os.path.join(workdir, path))
    best = max((m for m in mounts if inside == m[1] or inside.startswith(m[1].rstrip("/") + "/")),
               key=lambda m: len(m[1]), default=None)
    if best is None:
        return None
    src, dst = best
    return src + inside[len(dst):] if dst != "/" else os.path.join(src, inside.lstrip("/"))


def _blend_text(prefixes: list[str], weights: Optional[list[float]]) -> str:
    return " ".join(prefixes) if weights is None else " ".join(f"{w!r} {p}" for w, p in zip(weights, prefixes))


def host_view(cfg: Config, repo: Path, extra: str) -> tuple[Optional[Config], list[str]]:
    """(the config with every path the run uses replaced by its host location, []) when each lies in a mount; else
    (None, one line per path outside every mount). A glob keeps its pattern under its directory's host location."""
    mounts = parse_mounts(repo, extra)
    named = ", ".join(dst for _, dst in mounts)
    outside, changes = [], {}

    def mapped(key: str, value: str) -> str:
        literal = value[:min([value.index(c) for c in "*?[" if c in value], default=len(value))]
        base = value if literal == value else os.path.dirname(literal)
        found = host_path(base or ".", mounts, repo)
        if found is None:
            outside.append(f"{key} = {value!r} is outside every container mount ({named}): add HOST_DIR:DIR to "
                           f"{MOUNTS_VARIABLE} (comma-separated), or use a path under one of them")
            return value
        return found + ("/" if not base else "") + value[len(base):]

    for section, key in PATH_KEYS:
        value = str(cfg.run_dir) if (section, key) == ("logging", "run_dir") else getattr(getattr(cfg, section), key)
        if value is not None:
            changes.setdefault(section, {})[key] = mapped(f"{section}.{key}", str(value))
    for key, (prefixes, weights) in cfg.data.blends().items():
        changes.setdefault("data", {})[key] = _blend_text([mapped(f"data.{key}", p) for p in prefixes], weights)
    if outside:
        return None, outside
    view = dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in changes.items()})
    vars(view)["_given"] = set(vars(cfg).get("_given", ()))
    return view, []
