"""The torch optimizer the engine steps: a spec's update over flat fp32 master pieces, with fp32 or bf16 states."""
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch

from optim.spec import OptimizerSpec

STATE_CHUNK = 1 << 22  # elements: 16 MiB of fp32 per state at most, upcast at once (bf16 states)
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
    def step(self, closure=None):
        """Each piece with a gradient: the elementwise groups by weight decay in one update each; the whole
        matrices' directions, their updates from the engine (whole), applied."""
        buckets: dict = {}
        for group in self.param_groups:
            piece = group["params"][0]
            if piece.grad is not None:
                buckets.setdefault((group["matrix"], group["weight_decay"], group["lr"]), []).append((piece, group))
        for (matrix, weight_decay, lr), members in buckets.items():
            if not matrix:
                self._elementwise([p for p, _ in members], lr, weight_decay)
        matrices = [(key, members) for key, members in buckets.items() if key[0]]
        if matrices:
            self._matrices(matrices)

    def _elementwise(self, pieces: list, lr: float, weight_decay: float) -> None:
        states = [self._states(p) for p in pieces]
        names = self.spec.states
        if self.state_dtype == torch.float32:
            self.spec.update(pieces, [p.grad for p in pieces], {k: [s[k] for s in states] for k in names},
                             [s["step"] for s in states], lr, weight_decay, self.hyper, self.fused)
        else:
            for piece, state in zip(pieces, states):
                self.update_piece(piece, piece.grad, {k: state[k] for k in names}, state["step"],
                                  {"lr": lr, "weight_decay": weight_decay})
        for state in states:
            state["step"] += 1

    def update_piece(self, master, grad, states: dict, step, group: dict) -> None:
        """The spec's elementwise update of one piece (an NVMe chunk, a bf16 piece): the states in any dtype,
        computed in fp32 a STATE_CHUNK at a time. `step`: the count before this step (the caller counts)."""
        for lo in range(0, master.numel(), STATE_CHUNK):
            hi = min(lo + STATE_CHUNK, master.numel())
            upcast = {k: [s[lo:hi] if s.dtype == torch.float32 else s[lo:hi].float()] for k, s in states.items()}
            self.spec.update([master[lo:hi]], [grad[lo:hi]], upcast, [step], group["lr"],
                             group["weight_decay"], self.hyper, self.fused)
            for key, state in states.items():
                if state.dtype != torch.float32:
                    state[lo:hi].copy_(upcast[key][0])

    def _matrices(self, matrices: list) -> None:
        """Each piece's direction (its states updated), every whole matrix's update from `orthogonalize` at once
        (one exchange for the step), each applied with its group's lr and weight decay."""
        rule, entries, directions = self.spec.matrix, [], []
        for (_, weight_decay, lr), members in matrices:
            for piece, group in members:
                state = self._states(piece)
                directions.append(self._direction(piece, {k: state[k] for k in rule.states}))
                entries.append((piece, group, weight_decay, lr))
                state["step"] += 1
        pieces = [(group["group"], group["offset"], direction)
                  for (_, group, _, _), direction in zip(entries, directions)]
        del directions  # `orthogonalize` takes `pieces` over: it frees each direction once it has sent it
        updates = self.orthogonalize(pieces)
        for (piece, _, weight_decay, lr), update in zip(entries, updates):
            rule.apply([piece], [update], lr, weight_decay)

    def _direction(self, piece, states: dict) -> torch.Tensor:
        """The matrix rule's fp32 direction of one piece, its states updated (bf16: a chunk at a time)."""
        rule = self.spec.matrix
        if all(s.dtype == torch.float32 for s in states.values()):
            return rule.direction([piece.grad], {k: [s] for k, s in states.items()}, self.hyper)[0]
        out = torch.empty_like(piece)
        for lo in range(0, piece.numel(), STATE_CHUNK):
            hi = min(lo + STATE_CHUNK, piece.numel())
            upcast = {k: [s[lo:hi].float()] for k, s in states.items()}
            out[lo:hi] = rule.direction([piece.grad[lo:hi]], upcast, self.hyper)[0]
            for key, state in states.items():
                state[lo:hi].copy_(upcast[key][0])
        return out
