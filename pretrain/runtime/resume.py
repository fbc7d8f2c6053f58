"""What a resume changes, said (or refused) in one line before any rank builds its model: a finished run, a learning
rate schedule other than the checkpoint's, a train.init_from the checkpoint makes unused."""
import dataclasses
from types import SimpleNamespace
from typing import Optional

from pretrain.config import Config
from pretrain.errors import ConfigError
from pretrain.schedule import lr_at

# the keys lr_at reads besides train.steps: a change in any of them may change the learning rate of a resumed step
SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "decay_steps", "schedule", "decay_fraction", "decay_shape")
ALLOW_KEY = "train.allow_schedule_change"


def finished_line(usable: dict, cfg: Config) -> Optional[str]:
    """The line for a start whose checkpoint already reached train.steps (nothing to train: exit 0), else None."""
    step = usable["manifest"]["step"]
    if step < cfg.train.steps:
        return None
    return (f"{cfg.run_dir} is finished: {usable['path'].name} is step {step} of train.steps = {cfg.train.steps}; "
            "nothing to train, its records left as they are (raise train.steps to train on, or give the run another "
            "logging.name)")


def saved_schedule(saved: dict, cfg: Config) -> SimpleNamespace:
    """The checkpoint's train.steps and [optimizer] as lr_at reads them (a key the checkpoint lacks: this run's)."""
    optimizer = {**dataclasses.asdict(cfg.optimizer), **(saved.get("optimizer") or {})}
    steps = (saved.get("train") or {}).get("steps", cfg.train.steps)
    return SimpleNamespace(optimizer=SimpleNamespace(**optimizer), train=SimpleNamespace(steps=steps))


def schedule_lines(usable: dict, cfg: Config) -> list[str]:
    """A resume whose train.steps or schedule keys differ from the checkpoint's: one line when the learning rate of
    every step still to train is the same, or when train.allow_schedule_change = true lets it change; otherwise the
    ConfigError naming the first step whose learning rate would change."""
    saved = usable["manifest"].get("config")
    if not isinstance(saved, dict):  # a checkpoint without its config: nothing to compare with
        return []
    then = saved_schedule(saved, cfg)
    changes = [(f"optimizer.{k}", getattr(then.optimizer, k), getattr(cfg.optimizer, k)) for k in SCHEDULE_KEYS
               if getattr(then.optimizer, k) != getattr(cfg.optimizer, k)]
    if then.train.steps != cfg.train.steps:
        changes.insert(0, ("train.steps", then.train.steps, cfg.train.steps))
    if not changes:
        return []
    said = ", ".join(f"{key} {old} → {new}" for key, old, new in changes)
    name, start = usable["path"].name, usable["manifest"]["step"]
    first = next((s for s in range(start, max(cfg.train.steps, then.train.steps)) if lr_at(s, cfg) != lr_at(s, then)),
                 None)
    if first is None:
        return [f"{said} since {name}: the learning rate of every step from {start + 1} on is unchanged"]
    change = f"step {first + 1} would train at lr {lr_at(first, cfg):.6g} instead of {lr_at(first, then):.6g}"
    if cfg.train.allow_schedule_change:
        return [f"{said} since {name}: the learning-rate schedule changes ({change}); {ALLOW_KEY} = true"]
    raise ConfigError(f"resuming {name} with {said} changes its learning-rate schedule: {change}",
                      fix=f"keep the checkpoint's values, or set {ALLOW_KEY} = true to train on with the new schedule")


def init_from_line(usable: dict, cfg: Config) -> Optional[str]:
    """train.init_from beside a checkpoint of this run that is resumed: said, not silently dropped."""
    if not cfg.train.init_from:
        return None
    return (f"train.init_from = {cfg.train.init_from!r} is not used: this run resumes its own {usable['path'].name} "
            "(train.resume = false would start from the HF weights again)")
