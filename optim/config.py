"""[optimizer]'s engine keys (`OptimizerConfig`), checked when built: the common keys and the named optimizer's own."""
import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, Optional

from optim import SPECS
from optim.spec import raise_first

OPTIMIZER_KEYS = {name: spec.hyper for name, spec in SPECS.items()}  # each optimizer's own keys (its module's class)
OPTIMIZER_NAMES = tuple(OPTIMIZER_KEYS)


def key_owners(key: str) -> list:
    """The optimizers whose own keys include `key`."""
    return [name for name, keys in OPTIMIZER_KEYS.items() if key in {f.name for f in dataclasses.fields(keys)}]


def finite_checks(config) -> tuple:
    """(ok, message) per float field: inf or nan is never a valid setting (optimizer.lr = inf trains NaNs)."""
    return tuple((not isinstance(value, float) or math.isfinite(value),
                  f"optimizer.{key} = {value} is invalid; must be a finite number")
                 for key, value in vars(config).items())


@dataclass
class OptimizerConfig:
    """The engine's optimizer and its settings; the TOML `[optimizer]` section's engine keys, key for key (pretrain's
    section adds the learning-rate schedule). Validated in `__post_init__`: the common keys here, the named
    optimizer's own keys by its spec's class (OPTIMIZER_KEYS), and no key of another optimizer set."""

    # Which optimizer: "adamw"; "lion" (sign of an interpolated momentum); "sgd" (with momentum); "muon"
    # (Newton–Schulz-orthogonalized momentum on the hidden 2-D matrices, each taken whole across ZeRO and TP;
    # AdamW on embeddings, output layer, norms and biases). Its own keys are below; another's, set, is an error.
    name: Literal["adamw", "lion", "sgd", "muon"] = "adamw"
    # Dtype of the optimizer's per-element states (Adam's moments, momentum buffers), on the device and offloaded:
    # "bf16" halves them (K = 4 + 8 → 4 + 4 bytes a parameter for AdamW); the master stays fp32 and the update is
    # computed in fp32 (states upcast, updated, rounded back to nearest). With beta2 near 1 (1 − beta2 < 2⁻⁸) most of
    # the second moment's increments round away in bf16 (docs/optimizers.md).
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    # Peak learning rate (the loop passes each step's value to `engine.step(lr)`).
    lr: float = 1e-3
    # Decoupled weight decay, applied to the "decay" groups only (matrices; not biases or norms).
    weight_decay: float = 0.0
    # adamw, muon's AdamW part: the first moment's decay; lion: the interpolation whose sign is the update.
    beta1: float = 0.9
    # adamw, muon's AdamW part: the second moment's decay; lion: its momentum's decay (Lion's paper: 0.99).
    beta2: float = 0.999
    # adamw, muon's AdamW part: added to the denominator for numerical stability.
    eps: float = 1e-8
    # sgd, muon: the momentum buffer's decay μ (b ← μ·b + g); unset: sgd 0.9, muon 0.95.
    momentum: Optional[float] = None
    # sgd, muon: Nesterov momentum (the update g + μ·b instead of b); unset: sgd false, muon true.
    nesterov: Optional[bool] = None
    # muon: Newton–Schulz iterations per step; unset: 5.
    ns_steps: Optional[int] = None
    # Gradients are scaled so their global norm is at most this; 0 disables clipping.
    clip_grad: float = 0.0
    # Parameters that never decay beside biases and norms (which never do): comma-separated fnmatch patterns of
    # their names, e.g. "embedding.*" (word and position embeddings) or "*.linear_fc1.weight"; "" for none.
    no_weight_decay: str = ""

    def __post_init__(self):
        raise_first((
            *finite_checks(self),
            (self.name in OPTIMIZER_KEYS, f"optimizer.name = {self.name!r} is invalid; valid values: "
             + ", ".join(map(repr, OPTIMIZER_NAMES))),
            (self.state_dtype in ("fp32", "bf16"),
             f"optimizer.state_dtype = {self.state_dtype!r} is invalid; valid values: 'fp32', 'bf16'"),
            (self.lr > 0, f"optimizer.lr = {self.lr} must be > 0"),
            (self.clip_grad >= 0, f"optimizer.clip_grad = {self.clip_grad} must be >= 0 (0 disables)"),
            (self.weight_decay >= 0, f"optimizer.weight_decay = {self.weight_decay} is invalid; must be >= 0"),
            (all(p.strip() for p in self.no_weight_decay.split(",")) or not self.no_weight_decay,
             f"optimizer.no_weight_decay = {self.no_weight_decay!r} has an empty pattern; give comma-separated "
             "fnmatch patterns of parameter names, e.g. \"embedding.*,output_layer.weight\""),
            *((False, self.foreign_key_error(key)) for key in self.foreign_keys(self.changed_keys())),
        ))
        self.hyper  # noqa: B018 - the named optimizer's keys check themselves

    def changed_keys(self) -> list:
        """The optimizers' own keys whose value is not this class's default (set, for all the engine can tell)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [key for key in _OWNED_KEYS if getattr(self, key) != defaults[key]]

    def foreign_keys(self, given) -> list:
        """Those of `given` that belong only to other optimizers than `name`."""
        return [key for key in given if key in _OWNED_KEYS and self.name not in key_owners(key)]

    def foreign_key_error(self, key: str) -> str:
        return (f"optimizer.{key} is set but optimizer.name = {self.name!r} does not use it (it belongs to "
                f"{', '.join(key_owners(key))}); remove it or set optimizer.name to one of them")

    @property
    def hyper(self):
        """The named optimizer's own keys, built (and so checked) from this section's values (unset: its defaults)."""
        keys = OPTIMIZER_KEYS[self.name]
        return keys(**{f.name: getattr(self, f.name) for f in dataclasses.fields(keys) if getattr(self, f.name) is not None})

    @property
    def no_decay_patterns(self) -> tuple:
        return tuple(p.strip() for p in self.no_weight_decay.split(",") if p.strip())

    @property
    def betas(self) -> tuple:
        return (self.beta1, self.beta2)


_OWNED_KEYS = tuple(dict.fromkeys(f.name for keys in OPTIMIZER_KEYS.values() for f in dataclasses.fields(keys)))
