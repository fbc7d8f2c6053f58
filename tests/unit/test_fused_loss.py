"""The fused chunked loss (pretrain/model/loss.py, one TP rank) against torch's cross-entropy over the real vocabulary,
written out here: per-token loss and the gradients of the hidden states, the weight and the bias; padded rows get
none; a gradient that is not the loss mask times one number is refused. (TP 2, SP, the recomputed and megatron's
losses, and the model path: tests/dist/test_loss.py.)"""
import pytest
import torch

import pretrain.model.loss as loss_module
from pretrain.model.loss import (NOT_PROPORTIONAL, SoftmaxKernels, _logits_gradient, _softmax_gradient,
                                 _softmax_sums, add_product, adds_unrounded, chunked_loss, compiled_softmax)

S, B, H, WIDTH, VOCAB, CHUNK = 7, 3, 16, 40, 29, 4  # 21 tokens in chunks of 4 (the last 1); rows 29..39 padding
EAGER_SOFTMAX = SoftmaxKernels(_softmax_sums, _softmax_gradient)  # what model.compile compiles, run eagerly


def inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(S, B, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(WIDTH, H, generator=g) * 0.5).to(dtype).requires_grad_()
    bias = (torch.randn(WIDTH, generator=g) * 0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (S, B), generator=g)
    labels[0, 0] = VOCAB - 1  # the last real id
    mask = torch.rand(S, B, generator=g).round() * torch.linspace(0.5, 1.5, S * B).view(S, B)  # zeros, unequal weights
    return hidden, weight, bias, labels, mask


def reference(hidden, weight, bias, labels, mask):
    """torch's cross-entropy over the first VOCAB columns of hidden · weightᵀ + bias, in fp32; the masked mean."""
    hidden, weight, bias = (t.detach().float().requires_grad_() for t in (hidden, weight, bias))
    logits = hidden @ weight.t() + bias
    per_token = torch.nn.functional.cross_entropy(logits[..., :VOCAB].flatten(0, 1), labels.flatten(), reduction="none")
    ((per_token * mask.flatten()).sum() / mask.sum()).backward()
    return per_token.view(S, B), hidden.grad, weight.grad, bias.grad


def fused(hidden, weight, bias, labels, mask, grad_weights=None):
    per_token = chunked_loss(hidden, weight, bias, labels, CHUNK, False, None, VOCAB, loss_mask=mask)
    weights = mask if grad_weights is None else grad_weights
    ((per_token * weights).sum() / mask.sum()).backward()
    return per_token.detach(), hidden.grad, weight.grad, bias.grad


def test_fused_loss_and_every_gradient_equal_cross_entropy_over_the_real_vocabulary():
    args = inputs()
    expected = reference(*args)
    got = fused(*args)
    for name, a, b in zip(("loss", "hidden", "weight", "bias"), got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    assert got[2][VOCAB:].abs().max() == 0 and got[3][VOCAB:].abs().max() == 0  # padded rows: no gradient
    assert expected[2][:VOCAB].abs().max() > 1e-2  # the real rows do move
    # the padded columns matter: a softmax over all 40 columns gives another loss
    full = torch.nn.functional.cross_entropy((args[0] @ args[1].t() + args[2]).flatten(0, 1), args[3].flatten())
    assert abs(full.item() - got[0].flatten().mean().item()) > 1e-2


def test_without_a_loss_mask_every_token_counts_once():
    hidden, weight, bias, labels, _ = inputs()
    ones = torch.ones(S, B)
    expected = reference(hidden, weight, bias, labels, ones)
    per_token = chunked_loss(hidden, weight, bias, labels, CHUNK, False, None, VOCAB)
    per_token.mean().backward()
    for name, a, b in zip(("loss", "hidden", "weight", "bias"), (per_token, hidden.grad, weight.grad, bias.grad),
                          expected):
        torch.testing.assert_close(a.detach(), b, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_fused_loss_within_its_rounding_of_fp32(dtype):
    """bf16 / fp16 weights and hidden states: the logits GEMM in the model dtype, softmax and sums in fp32, the weight
    gradient summed over the chunks in fp32; within 4 units of the dtype's rounding (u = 2⁻⁸ bf16, 2⁻¹¹ fp16)
    relative to the largest element, of fp32 on the same rounded inputs."""
    args = inputs(dtype)
    expected = reference(*args)
    got = fused(*args)
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    for name, a, b in zip(("loss", "hidden", "weight", "bias"), got, expected):
        assert a.dtype == (torch.float32 if name == "loss" else dtype), name
        assert (a.float() - b).abs().max() <= 4 * u * b.abs().max(), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_without_a_bias_within_its_rounding_of_fp32(dtype):
    """The output layer as GPT and Llama models have it (no bias): the model-dtype gradient written straight from the
    softmax's division (the path a bias does not take), within the same 4 units of rounding as above."""
    hidden, weight, _, labels, mask = inputs(dtype)
    expected = reference(hidden, weight, torch.zeros(WIDTH), labels, mask)
    per_token = chunked_loss(hidden, weight, None, labels, CHUNK, False, None, VOCAB, loss_mask=mask)
    ((per_token * mask).sum() / mask.sum()).backward()
    u = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    for name, a, b in (("loss", per_token.detach(), expected[0]), ("hidden", hidden.grad, expected[1]),
                       ("weight", weight.grad, expected[2])):
        assert (a.float() - b).abs().max() <= 4 * u * b.abs().max(), name
    assert weight.grad[VOCAB:].abs().max() == 0  # padded rows: no gradient


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_model_dtype_logits_gradient_is_the_fp32_one_rounded_once(dtype, masked):
    """d loss / d logits in the model dtype: bit for bit ((exp / Σexp) − one-hot) × mask computed in fp32, then
    rounded once, for targets held on this rank or not (a TP shard)."""
    g = torch.Generator().manual_seed(1)
    n, width = 9, 33
    exps = torch.rand(n, width, generator=g) * torch.rand(n, 1, generator=g)
    sum_exp = exps.sum(dim=-1) * 1.3  # other TP ranks' exps too
    local = torch.randint(0, width, (n,), generator=g)
    held = torch.rand(n, generator=g) > 0.3
    local = torch.where(held, local, 0)
    mask = torch.linspace(0, 2, n) if masked else None
    onehot = torch.zeros(n, width)
    onehot[torch.arange(n), local] = held.float()
    expected = (exps / sum_exp.unsqueeze(-1) - onehot) * (mask.unsqueeze(-1) if masked else 1.0)
    got = _logits_gradient(exps.clone(), sum_exp, local, held, mask, dtype, None)
    assert got.dtype == dtype and torch.equal(got, expected.to(dtype))


def test_a_gradient_not_the_loss_mask_times_one_number_is_refused():
    """The weight gradient is summed over tokens in forward: backward can only scale it by one number."""
    args = inputs()
    with pytest.raises(RuntimeError, match="model.loss_recompute = true"):
        fused(*args, grad_weights=torch.linspace(0.5, 1.5, S * B).view(S, B))
    # On CUDA torch._assert_async refuses a message of 255 characters or more outright, on every call: each GPU
    # step with the fused loss failed so ("Message length must be smaller than 255", H200, torch 2.11)
    assert len(NOT_PROPORTIONAL) < 255


def test_without_gradients_the_loss_alone():
    hidden, weight, bias, labels, mask = inputs()
    with torch.no_grad():
        per_token = chunked_loss(hidden, weight, bias, labels, CHUNK, False, None, VOCAB, loss_mask=mask)
    assert not per_token.requires_grad
    torch.testing.assert_close(per_token, reference(hidden, weight, bias, labels, mask)[0], rtol=1e-6, atol=1e-6)


def test_the_weight_gradient_is_summed_without_a_whole_vocabulary_product():
    """bf16 at the Llama-3 8B slice's shapes (fake tensors: 8192 tokens, hidden 4096, 128256 columns, chunks of 1024):
    the only [V, h] tensor the fused loss makes is its fp32 sum; each chunk's bf16 product is made a block of rows at a
    time, no larger than the chunk's bf16 logits [1024, V] (a whole [V, h] product was 1.05 GB beside the sum)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(r.alias_info is not None for r in func._schema.returns):  # a view or an in-place op: no allocation
                return out
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.numel[t.dtype] = max(self.numel.get(t.dtype, 0), t.numel())
            return out

    tokens, hidden_size, width, chunk = 8192, 4096, 128256, 1024
    with FakeTensorMode():
        hidden = torch.empty(tokens, 1, hidden_size, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.empty(width, hidden_size, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.zeros(tokens, 1, dtype=torch.long)
        with Largest() as seen:
            chunked_loss(hidden, weight, None, labels, chunk, False, None, width)
    assert seen.numel[torch.float32] == width * hidden_size  # the gradient's fp32 sum
    assert seen.numel[torch.bfloat16] == chunk * width  # the chunk's logits; no bf16 tensor larger


def no_bias_run(dtype, masked: bool, kernels, chunk: int = CHUNK):
    """(per-token loss, hidden-state gradient, weight gradient) of the output layer without a bias (GPT's and Llama's),
    its loss the masked mean (or the mean), through `kernels` (None: the eager chunks)."""
    hidden, weight, _, labels, mask = inputs(dtype)
    weights = mask if masked else torch.ones(S, B)
    per_token = chunked_loss(hidden, weight, None, labels, chunk, False, None, VOCAB,
                             loss_mask=mask if masked else None, kernels=kernels)
    ((per_token * weights).sum() / weights.sum()).backward()
    return per_token.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_compiled_softmax_functions_give_the_eager_loss_and_gradients_bit_for_bit(dtype, masked):
    """SoftmaxKernels' two functions (what model.compile compiles for bf16 / fp16 models), run eagerly over the same
    chunks (21 tokens in chunks of 4, the last 1; 11 padded columns): the per-token loss and the hidden-state and
    weight gradients are the eager fused loss's to the bit, with and without a loss mask."""
    eager, kernels = no_bias_run(dtype, masked, None), no_bias_run(dtype, masked, EAGER_SOFTMAX)
    for name, a, b in zip(("loss", "hidden", "weight"), kernels, eager):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert eager[2][VOCAB:].abs().max() == 0 and eager[2][:VOCAB].abs().max() > 0  # padded rows: no gradient


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "mask"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_compiled_softmax_on_a_tp_shard_is_the_fp32_formula_rounded_once(dtype, masked):
    """On one TP rank's logits slice (some targets on other ranks; the max and Σexp over every rank's columns):
    _softmax_sums is this slice's Σ exp(logits − max) and the held targets' logit − max (0 for the others), and
    _softmax_gradient bit for bit ((exp(logits − max) / Σexp) − one-hot of the held targets) × mask computed in fp32
    and rounded once to the logits' dtype."""
    g = torch.Generator().manual_seed(2)
    n, width = 9, 33
    logits = (3 * torch.randn(n, width, generator=g)).to(dtype)
    top = logits.float().amax(dim=-1) + torch.rand(n, generator=g)  # another rank's column may hold the max
    local = torch.randint(0, width, (n,), generator=g)
    held = torch.rand(n, generator=g) > 0.3
    local = torch.where(held, local, 0)
    mask = torch.linspace(0, 2, n) if masked else None
    rows = torch.arange(n)
    exps = torch.exp(logits.float() - top.view(n, 1))
    sums = _softmax_sums(logits, top, local, held)
    torch.testing.assert_close(sums[0], exps.sum(dim=-1), rtol=1e-6, atol=0)
    assert torch.equal(sums[1], torch.where(held, logits.float()[rows, local] - top, 0.0))
    assert bool((~held).any() and held.any())
    sum_exp = 1.3 * sums[0]  # the other ranks' columns too
    onehot = torch.zeros(n, width)
    onehot[rows, local] = held.float()
    expected = (exps / sum_exp.view(n, 1) - onehot) * (mask.view(n, 1) if masked else 1.0)
    got = _softmax_gradient(logits, top, sum_exp, local, held, mask)
    assert got.dtype == dtype and torch.equal(got, expected.to(dtype))


def test_inductor_compiles_the_softmax_into_the_same_numbers():
    """compiled_softmax("inductor"), as model.compile makes it (its C++ kernels here), bf16 with a loss mask in chunks
    of 8 (21 tokens: 8, 8 and an uneven 5, which TorchDynamo recompiles for a dynamic chunk length): the loss within
    1e-6 of the eager fused loss's, relative, and the gradients within one bf16 rounding of its largest element
    (inductor's exp may round the last fp32 bit otherwise)."""
    eager, compiled = no_bias_run(torch.bfloat16, True, None, 8), no_bias_run(torch.bfloat16, True,
                                                                              compiled_softmax("inductor"), 8)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-6, atol=0)
    for name, a, b in zip(("hidden", "weight"), compiled[1:], eager[1:]):
        assert a.dtype == torch.bfloat16 and (a.float() - b.float()).abs().max() <= 2.0 ** -8 * b.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_estimators_loss_term_is_the_eager_fused_losss_measured_peak(dtype):
    """analysis/estimate.py's loss term against the bytes the eager fused loss makes and holds at once (torch's
    MemTracker: its peak of every tensor made inside, the inputs tracked apart), at a vocabulary of 8,000 that
    megatron pads to 8,064 columns: one chunk's logits over every column at 4 bytes each in fp32 (in place), 2 + 4 in
    half precision (the logits beside their fp32 copy), and the fp32 weight gradient and the hidden-state gradient
    kept from forward to backward. What the term leaves out is per-token vectors only (the losses, the sums, the
    targets' columns): under 48 bytes a token, whatever the vocabulary."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from analysis.loss_memory import loss_bytes
    from model_shape.gpt import GPTShape
    tokens, hidden_size, vocab, chunk = 256, 8, 8000, 128
    shape = GPTShape(layers=1, hidden=hidden_size, heads=1, seq=tokens, vocab=vocab)
    width = shape.padded_vocab(1)
    assert width == 8064  # megatron's multiple of 128
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, 1, hidden_size, generator=g).to(dtype).requires_grad_()
    weight = (0.02 * torch.randn(width, hidden_size, generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens, 1), generator=g)
    tracker = MemTracker()
    tracker.track_external(hidden, weight)
    with tracker:
        chunked_loss(hidden, weight, None, labels, chunk, False, None, vocab).mean().backward()
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    made = measured["Total"] - sum(t.untyped_storage().nbytes() for t in (hidden, weight))
    estimated = loss_bytes(shape, tokens, 1, hidden.element_size(), chunk)
    assert 0 <= made - estimated < 48 * tokens, (made, estimated)


REAL_ADDMM = torch.addmm


def gemm_adding_in(precision):
    """A stand-in for torch.addmm's out_dtype call (CUDA's; CPU has no such kernel): out = β·acc + α·a·b, acc taken in
    `precision` (None: dropped), the product in fp64, rounded once to fp32; other calls go to torch's."""
    def addmm(acc, a, b, *args, out_dtype=None, out=None, beta=1, alpha=1):
        if out_dtype is None:
            return REAL_ADDMM(acc, a, b, *args, out=out, beta=beta, alpha=alpha)
        assert out_dtype == torch.float32 and out is acc and acc.dtype == torch.float32
        assert a.dtype == b.dtype == torch.bfloat16 or a.dtype == b.dtype == torch.float16
        kept = 0 if precision is None else beta * acc.to(precision).double()
        added = alpha * (a.double() @ b.double()) + kept
        return out.copy_(added.float())
    return addmm


@pytest.mark.parametrize("precision, answer", [(torch.float32, True), (torch.bfloat16, False), (None, False)],
                         ids=["fp32-sum", "bf16-rounded-sum", "sum-dropped"])
def test_the_gemms_fp32_accumulation_is_asked_on_numbers_bf16_cannot_hold(monkeypatch, precision, answer):
    """adds_unrounded says yes only for a GEMM that adds the product into an fp32 value without rounding it: one that
    rounds the fp32 sum to bf16 first, or ignores it, answers no; CPU's torch (no out_dtype kernel) answers no."""
    assert not adds_unrounded(torch.device("cpu"))
    monkeypatch.setattr(torch, "addmm", gemm_adding_in(precision))
    assert adds_unrounded(torch.device("cpu")) is answer


def test_add_product_by_the_gemm_adds_the_fp32_product_unrounded(monkeypatch):
    """Where the GEMM accumulates in fp32, add_product hands it the operands as they are (a [m, k] · b [k, n] into
    acc): acc + a · b rounded once to fp32; elsewhere the bf16 product, added a block of rows at a time, is the product
    rounded to bf16 first, which differs from it."""
    g = torch.Generator().manual_seed(3)
    acc = torch.randn(37, 40, generator=g)
    a, b = torch.randn(37, 11, generator=g).bfloat16(), torch.randn(11, 40, generator=g).bfloat16()
    exact = (acc.double() + a.double() @ b.double()).float()
    blocked = acc.clone()
    add_product(blocked, a, b)  # CPU: the model-dtype product in blocks of rows no larger than `a` (37·11 // 40 = 10)
    assert torch.equal(blocked, acc + (a @ b).float()) and not torch.equal(blocked, exact)
    monkeypatch.setattr(loss_module, "fp32_accumulating_gemm", lambda device: True)
    monkeypatch.setattr(torch, "addmm", gemm_adding_in(torch.float32))
    fused_sum = acc.clone()
    add_product(fused_sum, a.t().contiguous().t(), b)  # a transposed view, as the fused loss hands grad_logitsᵀ
    assert torch.equal(fused_sum, exact)


def test_the_fused_loss_through_the_fp32_accumulating_gemm_within_bf16s_rounding_of_fp32(monkeypatch):
    """The bf16 fused loss with the GEMM adding each chunk's weight gradient into the fp32 sum (CUDA's path, the GEMM
    stood in for): loss and gradients within 4 units of bf16's rounding of fp32, the padded rows without gradient."""
    monkeypatch.setattr(loss_module, "fp32_accumulating_gemm", lambda device: True)
    monkeypatch.setattr(torch, "addmm", gemm_adding_in(torch.float32))
    hidden, weight, _, labels, mask = inputs(torch.bfloat16)
    expected = reference(hidden, weight, torch.zeros(WIDTH), labels, mask)
    per_token = chunked_loss(hidden, weight, None, labels, CHUNK, False, None, VOCAB, loss_mask=mask)
    ((per_token * mask).sum() / mask.sum()).backward()
    for name, a, b in (("loss", per_token.detach(), expected[0]), ("hidden", hidden.grad, expected[1]),
                       ("weight", weight.grad, expected[2])):
        assert (a.float() - b).abs().max() <= 4 * 2.0 ** -8 * b.abs().max(), name
    assert weight.grad[VOCAB:].abs().max() == 0
