"""The torch optimizer the engine steps: a spec's update over flat fp32 master pieces, with fp32 or bf16 states."""
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch

from optim.spec import STEP_CHUNK, OptimizerSpec, step_batches

STATE_TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class FlatTensor:
    """One fp32 master piece the optimizer updates, and where it lies among the engine's groups."""

    tensor: torch.Tensor
    weight_decay: float
    group: str = ""  # the engine group it belongs to
    offset: int = 0  # its first element's index in the group's master coordinates
    matrix: bool = False  # a group of whole matrices: the spec's matrix rule updates it


def hyper_of(spec: OptimizerSpec, config):
    """The spec's own keys from the [optimizer] section's values (unset ones: the spec's defaults)."""
    if spec.hyper is None:
        return None
    return spec.hyper(**{f.name: getattr(config, f.name) for f in fields(spec.hyper)
                         if getattr(config, f.name, None) is not None})


class FlatOptimizer(torch.optim.Optimizer):
    """`spec`'s update over `tensors` (one param group each: its weight decay, engine group, offset, kind).

    `fused`: the update's fused kernels (a GPU; the probe standing in for one), else its foreach kernels.
    `orthogonalize`: [(group, offset, direction)] -> [update] in the same order, the engine's whole-matrix step
    (zero3d/whole_matrix.py) for the groups of whole matrices; needed when any tensor is one."""

    def __init__(self, tensors: list, spec: OptimizerSpec, config, *, fused: bool,
                 orthogonalize: Optional[Callable] = None):
        groups = [{"params": [t.tensor], "weight_decay": t.weight_decay, "group": t.group, "offset": t.offset,
                   "matrix": t.matrix} for t in tensors]
        super().__init__(groups, {"lr": config.lr})
        self.spec, self.hyper, self.fused, self.orthogonalize = spec, hyper_of(spec, config), fused, orthogonalize
        self.state_dtype = STATE_TORCH_DTYPES[config.state_dtype]
        self._matrix = {t.tensor: t.matrix for t in tensors}  # piece -> a whole-matrix group's (tensors hash by identity)
        if any(t.matrix for t in tensors) and (spec.matrix is None or orthogonalize is None):
            raise ValueError(f"the {spec.name} optimizer got a group of whole matrices without "
                             + ("a matrix rule" if spec.matrix is None else "the engine's whole-matrix step"))

    # torch's own add_param_group without its TorchDynamo guard, which imports TorchDynamo on first use (0.7 CPU-s a
    # process); this optimizer is never traced
    add_param_group = torch.optim.Optimizer.add_param_group.__wrapped__

    # ------------------------------------------------------------ states and step counts

    def state_names(self, piece) -> tuple:
        """The per-element states the spec keeps for this piece (its group's kind)."""
        if piece not in self._matrix:
            raise KeyError(f"a tensor of {piece.numel()} elements is none of the {self.spec.name} optimizer's pieces")
        return self.spec.states_of(self._matrix[piece])

    def _step_tensor(self, piece, count: int) -> torch.Tensor:
        # a fused kernel reads the count on the tensors' device; the foreach kernels on the host
        return torch.tensor(float(count), dtype=torch.float32, device=piece.device if self.fused else "cpu")

    def initial_state(self, piece) -> dict:
        """What the first step creates for a piece: zero states in the state dtype and a step count of 0."""
        return {"step": self._step_tensor(piece, 0),
                **{key: torch.zeros(piece.shape, dtype=self.state_dtype, device=piece.device)
                   for key in self.state_names(piece)}}

    def step_count(self, pieces: list) -> int:
        """Steps taken (skipped fp16 overflow steps excluded)."""
        return int(self.state.get(pieces[0], {}).get("step", 0)) if pieces else 0

    def set_step_count(self, pieces: list, count: int) -> None:
        for piece in pieces:
            self.state[piece]["step"] = self._step_tensor(piece, count)

    def keep_mode(self) -> None:
        """After a load: each step count back on the device this optimizer's kernels read it from."""
        for piece, state in self.state.items():
            if "step" in state:
                state["step"] = self._step_tensor(piece, int(state["step"]))

    def _states(self, piece) -> dict:
        state = self.state[piece]
        if not state:
            state.update(self.initial_state(piece))
        return state

    # ------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None, grads: Optional[dict] = None):
        """Each piece with a gradient: the elementwise groups by weight decay in one update each; the whole
        matrices' directions, their updates from the engine (whole), applied.

        `grads`: {piece: (gradient, scales)} in place of the pieces' `.grad` (the device placement's): a gradient in
        any dtype, cast to fp32 and multiplied by each of `scales` in turn a STEP_CHUNK at a time on its way into the
        update, so no fp32 copy of a whole compute-dtype shard is made (its elements as that copy's would be)."""
        grads = {group["params"][0]: (group["params"][0].grad, ()) for group in self.param_groups
                 if group["params"][0].grad is not None} if grads is None else grads
        buckets: dict = {}
        for group in self.param_groups:
            piece = group["params"][0]
            if piece in grads:
                buckets.setdefault((group["matrix"], group["weight_decay"], group["lr"]), []).append((piece, group))
        for (matrix, weight_decay, lr), members in buckets.items():
            if not matrix:
                self._elementwise([p for p, _ in members], [grads[p] for p, _ in members], lr, weight_decay)
        matrices = [(key, members) for key, members in buckets.items() if key[0]]
        if matrices:
            self._matrices(matrices, grads)

    def _elementwise(self, pieces: list, grads: list, lr: float, weight_decay: float) -> None:
        states = [self._states(p) for p in pieces]
        names = self.spec.states
        if self.state_dtype == torch.float32 and all(g.dtype == torch.float32 and not k for g, k in grads):
            self.spec.update(pieces, [g for g, _ in grads], {k: [s[k] for s in states] for k in names},
                             [s["step"] for s in states], lr, weight_decay, self.hyper, self.fused)
        else:
            slices = [(i, lo, min(lo + STEP_CHUNK, p.numel())) for i, p in enumerate(pieces)
                      for lo in range(0, p.numel(), STEP_CHUNK)]
            for run in step_batches([hi - lo for _, lo, hi in slices], STEP_CHUNK):
                part = [slices[j] for j in run]
                self._update_slices([pieces[i][lo:hi] for i, lo, hi in part],
                                    [as_fp32(grads[i][0][lo:hi], grads[i][1]) for i, lo, hi in part],
                                    {k: [states[i][k][lo:hi] for i, lo, hi in part] for k in names},
                                    [states[i]["step"] for i, _, _ in part], lr, weight_decay)
        for state in states:
            state["step"] += 1

    def _update_slices(self, masters: list, grads: list, states: dict, steps: list, lr: float,
                       weight_decay: float) -> None:
        """The spec's update of fp32 slices, their states in any dtype (fp32_states)."""
        with fp32_states(states) as upcast:
            self.spec.update(masters, grads, upcast, steps, lr, weight_decay, self.hyper, self.fused)

    def update_piece(self, master, grad, states: dict, step, group: dict) -> None:
        """The spec's elementwise update of one piece (an NVMe chunk): the states in any dtype, computed in fp32 a
        STEP_CHUNK at a time. `step`: the count before this step (the caller counts)."""
        for lo in range(0, master.numel(), STEP_CHUNK):
            hi = min(lo + STEP_CHUNK, master.numel())
            self._update_slices([master[lo:hi]], [grad[lo:hi]], {k: [s[lo:hi]] for k, s in states.items()}, [step],
                                group["lr"], group["weight_decay"])

    def _matrices(self, matrices: list, grads: dict) -> None:
        """Each piece's direction (its states updated), every whole matrix's update from `orthogonalize` at once
        (one exchange for the step), each applied with its group's lr and weight decay."""
        rule, entries, directions = self.spec.matrix, [], []
        for (_, weight_decay, lr), members in matrices:
            for piece, group in members:
                state = self._states(piece)
                directions.append(self._direction(piece, *grads[piece], {k: state[k] for k in rule.states}))
                entries.append((piece, group, weight_decay, lr))
                state["step"] += 1
        pieces = [(group["group"], group["offset"], direction)
                  for (_, group, _, _), direction in zip(entries, directions)]
        del directions  # `orthogonalize` takes `pieces` over: it frees each direction once it has sent it
        updates = self.orthogonalize(pieces)
        for (piece, _, weight_decay, lr), update in zip(entries, updates):
            rule.apply([piece], [update], lr, weight_decay)

    def _direction(self, piece, grad, scales: tuple, states: dict) -> torch.Tensor:
        """The matrix rule's fp32 direction of one piece, its states updated (a compute-dtype gradient or bf16
        states: a STEP_CHUNK at a time, each chunk's gradient cast into the direction's own place, so the piece's
        direction and one chunk's are all the step holds)."""
        rule = self.spec.matrix
        if grad.dtype == torch.float32 and not scales and all(s.dtype == torch.float32 for s in states.values()):
            return rule.direction([grad], {k: [s] for k, s in states.items()}, self.hyper)[0]
        out = torch.empty_like(piece)
        for lo in range(0, piece.numel(), STEP_CHUNK):
            hi = min(lo + STEP_CHUNK, piece.numel())
            chunk = as_fp32(grad[lo:hi], scales, out=out[lo:hi])
            with fp32_states({k: [s[lo:hi]] for k, s in states.items()}) as upcast:
                chunk.copy_(rule.direction([chunk], upcast, self.hyper)[0])
        return out


def as_fp32(grad: torch.Tensor, scales: tuple = (), out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`grad` in fp32 multiplied by each of `scales` in turn: written into `out` when given, else a new tensor unless
    it is fp32 and there are no scales."""
    if out is None:
        if grad.dtype == torch.float32 and not scales:
            return grad
        out = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
    out.copy_(grad)
    for scale in scales:
        out.mul_(scale)
    return out


@contextmanager
def fp32_states(states: dict):
    """{name: [state slices]} as fp32 for an update: the fp32 ones themselves, the others upcast copies, written
    back into their own dtype once the update is done."""
    upcast = {k: [s if s.dtype == torch.float32 else s.float() for s in ss] for k, ss in states.items()}
    yield upcast
    for key, ss in states.items():
        for state, value in zip(ss, upcast[key]):
            if state.dtype != torch.float32:
                state.copy_(value)
