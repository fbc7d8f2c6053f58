"""AdamW (Loshchilov & Hutter 2019) as torch computes it: its two moments, and the one home of their names."""
from dataclasses import dataclass

from optim.spec import OptimizerSpec, beta_checks, raise_first


@dataclass(frozen=True)
class AdamWKeys:
    """AdamW's own keys of [optimizer]: the moments' decays and the denominator's epsilon."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    def __post_init__(self):
        raise_first(beta_checks(self) + ((self.eps > 0, f"optimizer.eps = {self.eps} is invalid; must be > 0"),))


ADAMW_STATES = ("exp_avg", "exp_avg_sq")  # torch's AdamW's own names: 4 + 2 × 4 bytes a parameter with the master


def adamw_update(params, grads, states, steps, lr, weight_decay, hyper, fused) -> None:
    """torch's functional AdamW over the lists: its fused kernel (`torch._fused_adamw_`, one launch for the lists)
    where `fused`, else its foreach kernels — on CPU bit for bit its single-tensor loop, the engine's update before
    the spec had kernels. torch counts this step in copies of `steps`."""
    from torch.optim.adamw import adamw
    adamw(params, grads, states["exp_avg"], states["exp_avg_sq"], [], [step.clone() for step in steps],
          foreach=not fused, fused=fused or None,
          amsgrad=False, beta1=hyper.beta1, beta2=hyper.beta2, lr=lr, weight_decay=weight_decay, eps=hyper.eps,
          maximize=False)


ADAMW = OptimizerSpec(name="adamw", hyper=AdamWKeys, states=ADAMW_STATES, update=adamw_update,
                      legacy_step_key="adam_step")
