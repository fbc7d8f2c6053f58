"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2): one momentum, a sign update."""
from zero3d.config import LionKeys
from zero3d.optim.spec import OptimizerSpec


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
