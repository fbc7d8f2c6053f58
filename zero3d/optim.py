"""The optimizer over flat fp32 tensors: apex FusedAdam on CUDA when importable, torch AdamW otherwise."""
import torch


def make_optimizer(tensors_and_decay: list, lr: float, betas: tuple, eps: float):
    """AdamW over [(flat fp32 tensor, weight_decay)]; elementwise, so flat or sharded updates agree."""
    groups = [{"params": [t], "weight_decay": wd} for t, wd in tensors_and_decay]
    on_cuda = all(t.is_cuda for t, _ in tensors_and_decay)
    if on_cuda:
        try:
            from apex.optimizers import FusedAdam
            return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
        except ImportError:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)
