"""Muon (Jordan 2024; scaled as Moonshot's Liu et al. 2025) for the hidden matrices, AdamW for the rest."""
import fnmatch
from dataclasses import dataclass

from optim.adamw import ADAMW
from optim.spec import MatrixRule, OptimizerSpec, beta_checks, raise_first


@dataclass(frozen=True)
class MuonKeys:
    """Muon's own keys of [optimizer]: its momentum and Newton–Schulz steps, and AdamW's (beta1, beta2, eps) for the
    parameters it does not take whole."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        raise_first(((0 <= self.momentum < 1, f"optimizer.momentum = {self.momentum} is invalid; must be in [0, 1)"),
                     (type(self.ns_steps) is int and self.ns_steps >= 1,
                      f"optimizer.ns_steps = {self.ns_steps!r} is invalid; must be an integer >= 1"),
                     *beta_checks(self),
                     (self.eps > 0, f"optimizer.eps = {self.eps} is invalid; must be > 0")))


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
RMS_SCALE = 0.2  # Moonshot: the update's RMS matched to AdamW's
NOT_HIDDEN = ("*embedding*", "*output_layer*", "*lm_head*")  # 2-D, yet AdamW's: the input and output layers


def takes_matrix(name: str, shape: tuple) -> bool:
    """A hidden matrix: 2-D, not an embedding nor an output layer (names matching NOT_HIDDEN)."""
    return len(shape) == 2 and not any(fnmatch.fnmatchcase(name, pattern) for pattern in NOT_HIDDEN)


def momentum_direction(grads, states, hyper) -> list:
    """b ← μ·b + g in place; the direction U = g + μ·b (Nesterov) or b, in fp32."""
    import torch
    buffers = states["momentum_buffer"]
    torch._foreach_mul_(buffers, hyper.momentum)
    torch._foreach_add_(buffers, grads)
    if not hyper.nesterov:
        return list(buffers)
    return torch._foreach_add(grads, buffers, alpha=hyper.momentum)


def newton_schulz(matrix, steps: int):
    """The orthogonalization of Muon (its quintic Newton–Schulz iteration), in fp32."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.mT
    x = x / (x.norm() + NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def orthogonalized_update(matrix, hyper):
    """NS5 of the whole matrix's direction, scaled to AdamW's RMS: 0.2·√max(rows, cols)."""
    return newton_schulz(matrix, hyper.ns_steps).mul_(RMS_SCALE * max(matrix.shape) ** 0.5)


def decoupled_apply(params, updates, lr, weight_decay) -> None:
    """W ← W·(1 − lr·λ) − lr·O."""
    import torch
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, updates, alpha=-lr)


MUON = OptimizerSpec(name="muon", hyper=MuonKeys, states=ADAMW.states, update=ADAMW.update,
                     matrix=MatrixRule(takes=takes_matrix, states=("momentum_buffer",), direction=momentum_direction,
                                       transform=orthogonalized_update, apply=decoupled_apply))
