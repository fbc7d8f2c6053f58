"""The layers' norms without apex: torch's LayerNorm or RMSNorm in megatron's spec (`TorchNorm`), and for a rank that
stands in for a CUDA one (the probe's CPU and fake ranks) an RMSNorm keeping for backward what CUDA's fused kernel keeps."""
import torch


class TorchNorm:
    """megatron's WrappedTorchNorm (the norm without apex: torch's LayerNorm or RMSNorm, as
    `config.normalization` says) for sequence parallelism and fused configs: under SP each TP rank
    normalises a slice of the sequence, so its weights carry megatron's `sequence_parallel` tag (as apex's
    FusedLayerNorm sets it) and their gradients are summed over TP."""

    KINDS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused_fused_options):
        if config.normalization not in cls.KINDS:
            raise ValueError(f"TorchNorm implements {', '.join(cls.KINDS)}, not {config.normalization!r}")
        norm = cls.KINDS[config.normalization](hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


class _RMSNormKeepingRstd(torch.autograd.Function):
    """y = x · rstd · w, rstd = 1 / √(mean(x²) + eps) over the last dimension, computed in fp32 as torch's rms_norm
    does and rounded once to x's dtype; kept for backward: x, w and the fp32 rstd, one a token, as CUDA's fused kernel
    keeps them (torch's composite rms_norm, which runs on CPU, keeps fp32 copies of x and of x · rstd instead)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        g = grad.float() * weight.float()
        dx = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        dw = (grad.float() * normed).reshape(-1, x.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


class RMSNormKeepingRstd(torch.nn.RMSNorm):
    """torch's RMSNorm whose backward keeps what CUDA's fused kernel keeps (x and an fp32 rstd), on any device."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return _RMSNormKeepingRstd.apply(x, self.weight, eps)


class CudaKeepingTorchNorm(TorchNorm):
    """TorchNorm for a CPU or fake rank standing in for a CUDA one: the RMSNorm keeps CUDA's x and rstd; LayerNorm's
    CPU kernel already keeps CUDA's x, mean and rstd."""

    KINDS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": RMSNormKeepingRstd}
