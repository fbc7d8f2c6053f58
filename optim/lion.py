"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2): one momentum, a sign update."""
from dataclasses import dataclass

from optim.spec import OptimizerSpec, beta_checks, raise_first


@dataclass(frozen=True)
class LionKeys:
    """Lion's own keys of [optimizer]: beta1 interpolates the update's sign, beta2 decays the momentum."""

    beta1: float = 0.9
    beta2: float = 0.99

    def __post_init__(self):
        raise_first(beta_checks(self))


def lion_update(params, grads, states, steps, lr, weight_decay, hyper, fused) -> None:
    """p ← p·(1 − lr·λ) − lr·sign(β1·m + (1 − β1)·g); m ← β2·m + (1 − β2)·g (foreach kernels; `fused` unused)."""
    import torch
    momenta = states["momentum"]
    signs = torch._foreach_mul(momenta, hyper.beta1)
    torch._foreach_add_(signs, grads, alpha=1 - hyper.beta1)
    torch._foreach_sign_(signs)
    if weight_decay:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_add_(params, signs, alpha=-lr)
    torch._foreach_mul_(momenta, hyper.beta2)
    torch._foreach_add_(momenta, grads, alpha=1 - hyper.beta2)


LION = OptimizerSpec(name="lion", hyper=LionKeys, states=("momentum",), update=lion_update)
