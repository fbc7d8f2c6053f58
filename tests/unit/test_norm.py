"""pretrain/model/norm.py's RMSNorm for ranks standing in for CUDA ones: torch's RMSNorm to the bit forward, its
gradients within fp32 rounding, and only x, the weight and one fp32 rstd a token kept for backward."""
import pytest
import torch

from pretrain.model.norm import RMSNormKeepingRstd


def saved_by(fn):
    """(result, [(shape, dtype)] of every tensor autograd saved while `fn` ran)."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return fn(), saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_keeping_rstd_is_torchs_rms_norm(dtype):
    torch.manual_seed(0)
    x = (torch.randn(3, 5, 64) * 3).to(dtype)
    reference, stand_in = torch.nn.RMSNorm(64, eps=1e-5, dtype=dtype), RMSNormKeepingRstd(64, eps=1e-5, dtype=dtype)
    with torch.no_grad():
        reference.weight.copy_(torch.rand(64) + 0.5)
        stand_in.weight.copy_(reference.weight)
    xr, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = reference(xr)
    ys, saved = saved_by(lambda: stand_in(xs))
    assert torch.equal(ys, yr)  # the same fp32 arithmetic, rounded once
    assert saved == [((3, 5, 64), dtype), ((64,), dtype), ((3, 5, 1), torch.float32)]  # x, w, rstd: CUDA's three
    grad = torch.randn(3, 5, 64).to(dtype)
    yr.backward(grad)
    ys.backward(grad)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(xs.grad, xr.grad, **tol)
    torch.testing.assert_close(stand_in.weight.grad, reference.weight.grad, **tol)


def test_torchs_composite_keeps_fp32_copies_the_stand_in_does_not():
    """What the stand-in is for: on CPU torch's RMSNorm keeps fp32 tensors of x's size for backward (the
    composite kernel), where CUDA's fused kernel and the stand-in keep one fp32 value a token."""
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    _, composite = saved_by(lambda: torch.nn.RMSNorm(64, dtype=torch.bfloat16)(x))
    _, stand_in = saved_by(lambda: RMSNormKeepingRstd(64, dtype=torch.bfloat16)(x))
    assert any(shape == (4, 64) and dtype == torch.float32 for shape, dtype in composite)
    assert [s for s in stand_in if s[1] == torch.float32] == [((4, 1), torch.float32)]
