"""SGD with momentum as torch computes it (Sutskever et al. 2013; torch.optim.SGD, no dampening)."""
from zero3d.config import SGDKeys
from zero3d.optim.spec import OptimizerSpec


def sgd_update(params, grads, states, steps, lr, weight_decay, hyper, fused) -> None:
    """torch's functional SGD (foreach): d = g + λ·p; b ← μ·b + d (a zero buffer's first step is torch's b = d);
    p ← p − lr·(d + μ·b if Nesterov else b). `fused` unused."""
    from torch.optim.sgd import sgd
    sgd(params, grads, states["momentum_buffer"], foreach=True, weight_decay=weight_decay, momentum=hyper.momentum,
        lr=lr, dampening=0.0, nesterov=hyper.nesterov, maximize=False)


SGD = OptimizerSpec(name="sgd", hyper=SGDKeys, states=("momentum_buffer",), update=sgd_update)
