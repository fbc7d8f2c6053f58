"""SGD with momentum as torch computes it (Sutskever et al. 2013; torch.optim.SGD, no dampening)."""
from dataclasses import dataclass

from optim.spec import OptimizerSpec, raise_first


@dataclass(frozen=True)
class SGDKeys:
    """SGD's own keys of [optimizer]: torch's rule (momentum buffer μ·b + g, weight decay added to the gradient)."""

    momentum: float = 0.9
    nesterov: bool = False

    def __post_init__(self):
        raise_first(((0 <= self.momentum < 1, f"optimizer.momentum = {self.momentum} is invalid; must be in [0, 1)"),))


def sgd_update(params, grads, states, steps, lr, weight_decay, hyper, fused) -> None:
    """torch's functional SGD (foreach): d = g + λ·p; b ← μ·b + d (a zero buffer's first step is torch's b = d);
    p ← p − lr·(d + μ·b if Nesterov else b). `fused` unused."""
    from torch.optim.sgd import sgd
    sgd(params, grads, states["momentum_buffer"], foreach=True, weight_decay=weight_decay, momentum=hyper.momentum,
        lr=lr, dampening=0.0, nesterov=hyper.nesterov, maximize=False)


SGD = OptimizerSpec(name="sgd", hyper=SGDKeys, states=("momentum_buffer",), update=sgd_update)
