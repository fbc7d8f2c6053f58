"""fp16 dynamic loss scaling: the same decision on every rank because it is fed the same overflow flag."""
from typing import Optional

from zero3d.config import LossScaleConfig


class LossScaler:
    """Scale the loss by `scale`; back off on overflow (after `hysteresis` of them), grow when clean.

    The settings are the `LossScaleConfig` it is built from; it holds only the state that changes.
    `update(found_overflow)` must be called with a flag all ranks agree on (the engine derives it
    from the globally all-reduced gradient norm), so every rank's scaler stays identical.
    """

    def __init__(self, config: LossScaleConfig):
        self.config = config
        self.scale = config.initial_loss_scale
        self.clean_steps = 0
        self.overflows_left = config.hysteresis

    def update(self, found_overflow: bool) -> None:
        c = self.config
        if found_overflow:
            self.clean_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale * c.backoff_factor, c.min_loss_scale)
                self.overflows_left = c.hysteresis
            return
        self.clean_steps += 1
        if self.clean_steps % c.growth_interval == 0:
            self.scale *= c.growth_factor
            self.overflows_left = c.hysteresis

    def state_dict(self) -> dict:
        return dict(scale=self.scale, clean_steps=self.clean_steps, overflows_left=self.overflows_left)

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self.clean_steps = state["clean_steps"]
        self.overflows_left = state["overflows_left"]


class NoScaler:
    """bf16/fp32: no loss scaling; overflow still skips the step (the norm is not finite)."""

    scale = 1.0

    def update(self, found_overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def make_scaler(config: Optional[LossScaleConfig]):
    """A fresh LossScaler for fp16 (`config` given), else NoScaler."""
    return NoScaler() if config is None else LossScaler(config)
