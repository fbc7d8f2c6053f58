"""zero3d.engine.sum_of_squares, the gradient norm's sum: Σ x² in fp64 from fp32 block norms, whatever the pieces'
lengths against the block (one short block, several, a tail), within fp32's rounding of the exact fp64 sum; an inf or
a nan anywhere reaches the sum (the overflow rule skips that step)."""
import pytest
import torch

import zero3d.engine as engine


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(engine, "NORM_BLOCK", 7)


@pytest.mark.parametrize("lengths", [[], [1], [5], [7], [15, 3, 22], [0, 9]])
def test_sum_of_squares_is_the_fp64_sum_within_fp32_rounding(small_blocks, lengths):
    g = torch.Generator().manual_seed(len(lengths))
    pieces = [torch.randn(n, generator=g) * 10 ** torch.randint(-3, 4, (n,), generator=g) for n in lengths]
    got = engine.sum_of_squares(pieces)
    exact = sum((p.double() ** 2).sum() for p in pieces) if pieces else torch.tensor(0.0, dtype=torch.float64)
    assert got.dtype == torch.float64 and got.dim() == 0
    assert got.item() == pytest.approx(exact.item(), rel=1e-6, abs=0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_gradient_reaches_the_sum(small_blocks, bad):
    pieces = [torch.ones(10), torch.ones(12)]
    pieces[1][9] = bad  # in the second block of the second piece
    assert not torch.isfinite(engine.sum_of_squares(pieces))


def test_bf16_gradients_are_summed_in_fp32(small_blocks):
    """A bf16 gradient's squares summed in bf16 would lose the small ones beside 256 (2⁸ = bf16's 8 bits)."""
    x = torch.cat([torch.tensor([16.0]), torch.full((6,), 0.5)]).to(torch.bfloat16)  # one block: 256 + 6 × 0.25
    assert engine.sum_of_squares([x]).item() == pytest.approx(257.5, rel=1e-6)  # bf16 sums: 256


def test_a_sum_past_fp32s_range_stays_finite(small_blocks):
    """Each block's 2-norm fits fp32 (1.3e19 < 1.8e19); their squares' sum, 5.25e38, is past fp32's 3.4e38: in fp64 it
    is a finite norm of 2.3e19, not an overflow that would skip the step."""
    pieces = [torch.full((7,), 5e18) for _ in range(3)]
    assert engine.sum_of_squares(pieces).item() == pytest.approx(21 * 25e36, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compute_dtype_pieces_give_the_norm_of_their_unscaled_fp32_copy(small_blocks, dtype):
    """Gradients a mixed-precision step reads in the compute dtype, each block normed as it is and its norm unscaled
    (a power-of-two loss scale), give bit for bit the sum of their fp32 copy unscaled whole, as the engine makes it for
    the other placements; values from 1e-3 to 1e3, so unscaled in fp16 the small ones would fall below its normal
    range (6.1e-5) and lose bits. A scale that is no power of two: within fp32's rounding of the exact sum."""
    g = torch.Generator().manual_seed(0)
    pieces = [(torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 4, (n,), generator=g)).to(dtype)
              for n in (15, 3, 22)]
    unscale = 1 / 1024
    copies = [p.float() * unscale for p in pieces]
    assert torch.equal(engine.sum_of_squares(pieces, unscale), engine.sum_of_squares(copies))
    assert torch.equal(engine.sum_of_squares(pieces), engine.sum_of_squares([p.float() for p in pieces]))
    exact = sum(((p.double() / 3) ** 2).sum() for p in pieces)
    assert engine.sum_of_squares(pieces, 1 / 3).item() == pytest.approx(exact.item(), rel=1e-6, abs=0)


def test_compute_dtype_pieces_are_read_without_a_copy(monkeypatch):
    """The norm reads a bf16 gradient as it is: no operator makes a tensor of the gradient's size in any dtype (the
    fp32 copy it made before moved 5× the bytes the kernel reads), only the blocks' norms and their sum."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not any(r.alias_info is not None for r in func._schema.returns):  # not a view
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        Largest.numel = max(Largest.numel, t.numel())
            return out

    monkeypatch.setattr(engine, "NORM_BLOCK", 16)
    pieces = [torch.randn(40).bfloat16(), torch.randn(33).bfloat16()]
    with Largest():
        engine.sum_of_squares(pieces, 1 / 8)
    assert Largest.numel == 3 + 3  # the stacked norms of 3 + 3 blocks: nothing the size of a block (16) or a piece


def test_pieces_of_two_dtypes_are_refused():
    with pytest.raises(ValueError, match=r"one dtype .*torch.bfloat16.*torch.float32"):
        engine.sum_of_squares([torch.ones(3), torch.ones(3).bfloat16()])
