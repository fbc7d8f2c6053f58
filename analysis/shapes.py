"""Shapes people train: the aspect-ratio rule `--largest --shape-rule trained` searches (docs/estimator.md, Shapes)."""
import itertools
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class ShapeRule:
    """GPT shapes with published aspect ratios: min_ratio ≤ hidden / layers ≤ max_ratio.

    Published shapes (hidden / layers): the paper's 170B 8192 / 212 = 38.6 and GPT-2 1.5B 1600 / 48 = 33.3 (the
    deepest); Llama-3 8B 4096 / 32 = 128, 70B 8192 / 80 = 102, 405B 16384 / 126 = 130.0, GPT-3 175B
    12288 / 96 = 128 (the widest).
    """

    min_ratio: int = 32  # hidden / layers at least this: layers ≤ ⌊hidden / min_ratio⌋
    max_ratio: int = 131  # hidden / layers at most this: layers ≥ ⌈hidden / max_ratio⌉
    hidden_step: int = 1024  # hidden sizes searched: hidden_step, 2·hidden_step, ...
    head_dim: int = 128  # head size (heads = hidden / head_dim) ...
    small_head_dim: int = 64  # ... or this one below small_hidden (GPT-2/3's small models)
    small_hidden: int = 2048  # hidden sizes below this use small_head_dim

    def __post_init__(self):
        for name in ("min_ratio", "max_ratio", "hidden_step", "head_dim", "small_head_dim", "small_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"shape rule {name} = {value!r} is invalid; must be a positive integer")
        if self.min_ratio > self.max_ratio:
            raise ValueError(f"shape rule min_ratio = {self.min_ratio} is invalid; must be <= max_ratio = "
                             f"{self.max_ratio}")
        if self.hidden_step % self.head_dim or self.hidden_step % self.small_head_dim:
            raise ValueError(f"shape rule hidden_step = {self.hidden_step} is invalid; must be a multiple of "
                             f"head_dim {self.head_dim} and small_head_dim {self.small_head_dim}")

    def heads(self, hidden: int) -> int:
        return hidden // (self.small_head_dim if hidden < self.small_hidden else self.head_dim)

    def layer_bounds(self, hidden: int) -> tuple[int, int]:
        """(fewest, most) layers at `hidden`: ⌈hidden / max_ratio⌉, ⌊hidden / min_ratio⌋."""
        return -(-hidden // self.max_ratio), hidden // self.min_ratio

    def shapes(self) -> Iterator[tuple]:
        """(hidden, heads) for hidden = hidden_step, 2·hidden_step, ... without end."""
        return ((h, self.heads(h)) for h in itertools.count(self.hidden_step, self.hidden_step))

    def describe(self) -> str:
        return (f"shape rule: {self.min_ratio} ≤ hidden/layers ≤ {self.max_ratio} (the paper's 170B 8192/212 = 38.6 "
                f"… Llama-3 405B 16384/126 = 130), hidden in steps of {self.hidden_step}, head size "
                f"{self.head_dim} ({self.small_head_dim} below hidden {self.small_hidden})")


TRAINED = ShapeRule()
