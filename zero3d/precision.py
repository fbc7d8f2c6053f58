"""fp16 dynamic loss scaling: the same decision on every rank because it is fed the same overflow flag."""
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class LossScaleConfig:
    """fp16 dynamic loss scaling settings (the engine builds its own LossScaler from them)."""

    initial_scale: float = 2.0**16
    min_scale: float = 1.0
    growth_interval: int = 1000  # clean steps before the scale grows
    backoff_factor: float = 0.5
    hysteresis: int = 2  # overflows tolerated before backing off
    growth_factor: float = 2.0


@dataclass
class LossScaler:
    """Scale the loss by `scale`; back off on overflow (after `hysteresis` of them), grow when clean.

    `update(found_overflow)` must be called with a flag all ranks agree on (the engine derives it
    from the globally all-reduced gradient norm), so every rank's scaler stays identical.
    """

    scale: float = 2.0**16
    min_scale: float = 1.0
    growth_interval: int = 1000
    backoff_factor: float = 0.5
    hysteresis: int = 2
    growth_factor: float = 2.0
    clean_steps: int = 0
    overflows_left: int = -1  # set from hysteresis on first use

    def __post_init__(self):
        if self.overflows_left < 0:
            self.overflows_left = self.hysteresis

    def update(self, found_overflow: bool) -> None:
        if found_overflow:
            self.clean_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
                self.overflows_left = self.hysteresis
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor
            self.overflows_left = self.hysteresis

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
    if config is None:
        return NoScaler()
    return LossScaler(scale=config.initial_scale, min_scale=config.min_scale,
                      growth_interval=config.growth_interval, backoff_factor=config.backoff_factor,
                      hysteresis=config.hysteresis, growth_factor=config.growth_factor)
