"""The learning-rate schedule: a pure function of the step, so a resumed run continues the same sequence."""
import math

SCHEDULES = ("cosine", "linear", "constant", "wsd", "inverse_sqrt")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def decayed(lr: float, min_lr: float, shape: str, progress: float) -> float:
    """The learning rate `progress` ∈ [0, 1] of the way through a decay from lr to min_lr of `shape`."""
    if shape == "cosine":  # this expression's order: the runs before the other schedules existed, bit for bit
        return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
    if shape == "linear":
        return min_lr + (lr - min_lr) * (1.0 - progress)
    if shape == "1-sqrt":  # Hägele et al. 2024: the WSD cool-down that matches cosine
        return min_lr + (lr - min_lr) * (1.0 - math.sqrt(progress))
    raise ValueError(f"decay shape {shape!r} is not one of {DECAY_SHAPES}")


def lr_at(step: int, cfg) -> float:
    """The learning rate of 0-based `step` under cfg.optimizer's schedule, for a run of cfg.train.steps.

    Every schedule warms up linearly over `warmup_steps` (lr · (step + 1) / warmup_steps), then
      cosine        cosine from lr to min_lr at `decay_steps` (unset: train.steps), min_lr after;
      linear        the same, in a straight line;
      constant      lr;
      inverse_sqrt  lr · √(max(warmup_steps, 1) / (step + 1)), never below min_lr;
      wsd           lr until the last `decay_fraction` of the steps to `decay_steps`, then to min_lr in
                    `decay_shape` (linear, cosine or 1-sqrt), min_lr after.
    """
    o = cfg.optimizer
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    if o.schedule == "inverse_sqrt":
        return max(o.min_lr, o.lr * math.sqrt(max(o.warmup_steps, 1) / (step + 1)))
    end = o.decay_steps or cfg.train.steps
    if o.schedule == "wsd":
        start, shape = end - round(o.decay_fraction * (end - o.warmup_steps)), o.decay_shape
    else:
        start, shape = o.warmup_steps, o.schedule
    if step < start:
        return o.lr
    return decayed(o.lr, o.min_lr, shape, 1.0 if step >= end else (step - start) / (end - start))
