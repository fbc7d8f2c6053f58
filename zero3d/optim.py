"""The engine's optimizer over flat fp32 tensors: apex FusedAdam on CUDA when importable, torch AdamW otherwise."""
import torch


def _groups(tensors_and_decay: list) -> list:
    return [{"params": [t], "weight_decay": wd} for t, wd in tensors_and_decay]


def fused_adamw(tensors_and_decay: list, lr: float, betas: tuple, eps: float) -> torch.optim.AdamW:
    """torch's fused AdamW (one kernel, no full-size scratch): what a GPU without apex runs. The one
    place it is built: make_optimizer's fallback, and the rank-local probe standing in for a GPU."""
    return torch.optim.AdamW(_groups(tensors_and_decay), lr=lr, betas=betas, eps=eps, fused=True)


def make_optimizer(tensors_and_decay: list, lr: float, betas: tuple, eps: float):
    """AdamW over [(flat fp32 tensor, weight_decay)]; elementwise, so flat or sharded updates agree."""
    if all(t.is_cuda for t, _ in tensors_and_decay):
        try:
            from apex.optimizers import FusedAdam
            return FusedAdam(_groups(tensors_and_decay), lr=lr, betas=betas, eps=eps, adam_w_mode=True)
        except ImportError:
            return fused_adamw(tensors_and_decay, lr, betas, eps)
    return torch.optim.AdamW(_groups(tensors_and_decay), lr=lr, betas=betas, eps=eps, foreach=False)
