"""What an optimizer is to the engine (`OptimizerSpec`): its keys, its states per kind of group and its update."""
from dataclasses import dataclass
from typing import Callable, Optional

MASTER_BYTES = 4  # the fp32 master copy of a parameter, whatever the optimizer
STATE_DTYPES = {"fp32": 4, "bf16": 2}  # optimizer.state_dtype -> bytes per element of each state
STEP_CHUNK = 1 << 22  # the most gradient elements a step casts to fp32 at once (with their bf16 states): 16 MiB each


def step_batches(sizes: list, limit: int) -> list:
    """Indices of `sizes` in order, in consecutive runs of total size <= `limit` (an item larger than `limit`: alone):
    what a step casts to fp32 at once (`limit`: STEP_CHUNK) — one kernel launch a run, never the whole shard."""
    runs, run, total = [], [], 0
    for i, size in enumerate(sizes):
        if run and total + size > limit:
            runs.append(run)
            run, total = [], 0
        run.append(i)
        total += size
    return runs + [run] if run else runs


class OptimizerConfigError(ValueError):
    """An [optimizer] setting is invalid; the message names the key, the value and what is valid."""


def raise_first(checks) -> None:
    """Raise the message of the first failed (ok, message) check."""
    for ok, message in checks:
        if not ok:
            raise OptimizerConfigError(message)


def beta_checks(keys) -> tuple:
    """(ok, message) for an optimizer's beta1 and beta2: each in [0, 1)."""
    return tuple((0 <= getattr(keys, k) < 1, f"optimizer.{k} = {getattr(keys, k)} is invalid; must be in [0, 1)")
                 for k in ("beta1", "beta2"))


@dataclass(frozen=True)
class MatrixRule:
    """How a spec updates the 2-D parameters it takes whole (Muon's hidden matrices): a direction per element
    (its own states, updated in place), a transform of the whole matrix's direction, and the update applied."""

    takes: Callable
    """(parameter name, shape) -> whether the rule updates it (Muon: 2-D, not an embedding or output layer)."""

    states: tuple
    """Its per-element states (Muon: momentum_buffer), kept like every other state (sharded, offloaded, saved)."""

    direction: Callable
    """(grads, {state: [tensors]}, hyper) -> [fp32 direction per tensor]; updates the states in place."""

    transform: Callable
    """(whole matrix's direction, 2-D fp32, hyper) -> the matrix's update (Muon: Newton–Schulz, scaled)."""

    apply: Callable
    """(params, updates, lr, weight_decay) -> None: the update applied to the fp32 masters in place."""


@dataclass(frozen=True)
class OptimizerSpec:
    """An optimizer over flat fp32 master tensors: elementwise, so a sharded update equals the whole one, except
    for the parameters its `matrix` rule takes whole (the engine hands it each such matrix whole)."""

    name: str
    """Its `optimizer.name`, and the name a checkpoint's manifest records (`optimizer`)."""

    hyper: Optional[type]
    """Its own keys of [optimizer], a dataclass that validates itself (built by OptimizerConfig.hyper); None: no keys."""

    states: tuple
    """Its per-element states over the groups it updates elementwise: keys of `optimizer.state[piece]`, checkpoint
    tensors "optim/<state>/<key>" and, under NVMe offload, files."""

    update: Callable
    """(params, grads, {state: [tensors]}, steps, lr, weight_decay, hyper, fused) -> None: one step over lists of
    fp32 tensors (the states fp32 too), in place; `steps`: 0-dim fp32 tensors, the steps taken before this one (read
    only: the optimizer counts). `fused`: the device's fused kernels where the update has them (a GPU)."""

    matrix: Optional[MatrixRule] = None
    """The parameters it takes whole, and how (None: every parameter elementwise)."""

    legacy_step_key: Optional[str] = None
    """The manifest key its step count had before the spec-neutral `optimizer_step` (AdamW's, optim/adamw.py):
    read from checkpoints that lack `optimizer_step`, and still written beside it."""

    def states_of(self, matrix: bool) -> tuple:
        """The states of a group: the matrix rule's for a group of whole matrices, else the elementwise ones."""
        return self.matrix.states if matrix and self.matrix else self.states

    def bytes_per_element(self, matrix: bool = False, state_dtype: str = "fp32") -> int:
        """Bytes of state per element of a group's master (the master's own 4 bytes not included)."""
        return len(self.states_of(matrix)) * STATE_DTYPES[state_dtype]

    def takes_whole(self, name: str, shape: tuple) -> bool:
        return self.matrix is not None and self.matrix.takes(name, tuple(shape))
