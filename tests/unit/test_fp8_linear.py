"""precision.fp8's linear function (pretrain/model/fp8.py) against the recipes written out here from their statement
(docs/fp8.md, torchao's tensorwise and rowwise recipes): quantize each operand with its stated scale rule, dequantize
with the inverse scale, multiply in fp32, round once to bf16. Equal to the bit: torch._scaled_mm's CPU kernel is that
computation (test_scaled_mm_on_cpu_dequantizes_then_multiplies_in_fp32, the fact docs/fp8.md states)."""
import math

import pytest
import torch

from fp8_reference import E4M3, E5M2, LARGEST, reference

def run_function(recipe: str, x, w, b, g):
    """(y, dx, dW, db) of the FP8 linear function on fresh copies of the operands."""
    return run_on(recipe, x, torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone()), g)


def run_on(recipe: str, x, w: torch.nn.Parameter, b: torch.nn.Parameter, g):
    from pretrain.model.fp8 import Float8LinearFunction
    from zero3d.float8 import RECIPES
    x = x.clone().requires_grad_(True)
    w.grad = b.grad = None
    y = Float8LinearFunction.apply(x, w, b, RECIPES[recipe], False, False, None)
    y.backward(g)
    return y.detach(), x.grad, w.grad, b.grad


def operands(seed: int, s=8, batch=4, k=64, n=48):
    """A [s, b, k] input (megatron's layout) with an outlier, a weight of std 0.02, a bias, an output gradient."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(s, batch, k, generator=gen).bfloat16()
    x[3, 1, 7] = 40.0  # one large activation: tensorwise scales it for everyone, rowwise for its row only
    w = (0.02 * torch.randn(n, k, generator=gen)).bfloat16()
    b = (0.1 * torch.randn(n, generator=gen)).bfloat16()
    g = (1e-3 * torch.randn(s, batch, n, generator=gen)).bfloat16()
    return x, w, b, g


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_forward_and_backward_equal_the_recipe_to_the_bit(recipe):
    x, w, b, g = operands(0)
    y, dx, dw, db = run_function(recipe, x, w, b, g)
    ref_y, ref_dx, ref_dw, ref_db = reference(recipe, x.reshape(-1, 64), w, g.reshape(-1, 48))
    assert torch.equal(y, (ref_y + b).reshape(y.shape))  # the bias added in bf16 after the GEMM, as megatron's
    assert torch.equal(dx, ref_dx.reshape(dx.shape))
    assert torch.equal(dw, ref_dw)
    assert torch.equal(db, ref_db)
    # and it is not the bf16 GEMM: float8 rounding moves the output by far more than bf16's
    plain = (x.reshape(-1, 64).float() @ w.float().t())
    assert (y.reshape(-1, 48).float() - b.float() - plain).abs().max() > 1e-3 * plain.abs().max()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_scales_are_the_current_tensors_amax(recipe):
    """Dynamic current scaling: a weight that changed since the last call (an optimizer step) is cast with its new
    amax, not an earlier one: the second call equals the recipe applied to the new weight."""
    x, w, b, g = operands(3)
    weight, bias = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())
    run_on(recipe, x, weight, bias, g)
    with torch.no_grad():
        weight.mul_(5.0)  # every amax five times larger
    y, dx, dw, _ = run_on(recipe, x, weight, bias, g)
    ref_y, ref_dx, ref_dw, _ = reference(recipe, x.reshape(-1, 64), weight.detach(), g.reshape(-1, 48))
    assert torch.equal(y, (ref_y + b).reshape(y.shape))
    assert torch.equal(dx, ref_dx.reshape(dx.shape)) and torch.equal(dw, ref_dw)


@pytest.mark.parametrize("recipe, reductions", [pytest.param("tensorwise", 1, id="tensorwise"),
                                                 pytest.param("rowwise", 4, id="rowwise")])
def test_backward_takes_the_amax_only_of_what_forward_did_not_scale(recipe, reductions):
    """Tensorwise, backward casts x and W with the scales forward took (the same tensors: the same amax, so the same
    codes, bit for bit the recipe: test_forward_and_backward_equal_the_recipe_to_the_bit) and reduces only dy for
    its amax; rowwise scales x and W along other axes in backward, so it reduces dy per row and per column, W and
    x. Counted as the amax reductions (torch.linalg.vector_norm at ord inf) backward runs, against forward's two."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from pretrain.model.fp8 import Float8LinearFunction
    from zero3d.float8 import RECIPES

    class Reductions(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.amax = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.amax += func.overloadpacket == torch.ops.aten.linalg_vector_norm
            return func(*args, **(kwargs or {}))

    x, w, b, g = operands(7)
    x.requires_grad_(True)
    forward, backward = Reductions(), Reductions()
    with forward:
        y = Float8LinearFunction.apply(x, torch.nn.Parameter(w), None, RECIPES[recipe], False, False, None)
    with backward:
        y.backward(g)
    assert (forward.amax, backward.amax) == (2, reductions)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_large_operand_cast_in_row_blocks_is_cast_alike(monkeypatch, recipe):
    """zero3d.float8.CAST_CHUNK bounds a cast's fp32 staging: an operand above it is cast a block of rows at a time
    (here 1000 elements: 15-row blocks of the [32, 64] input, per-row scales sliced along), to the same bits."""
    import zero3d.float8
    x, w, b, g = operands(5)
    whole = run_function(recipe, x, w, b, g)
    monkeypatch.setattr(zero3d.float8, "CAST_CHUNK", 1000)
    blocks = run_function(recipe, x, w, b, g)
    for a, c in zip(whole, blocks):
        assert torch.equal(a, c)


def test_the_two_recipes_differ_where_they_say_they_do():
    """An outlier of 2·10⁵ in one row of x: tensorwise gives every row the outlier's scale, pushing the others into
    e4m3's subnormals (an x of 1 becomes 448 / 2·10⁵ ≈ 2⁻⁸, e4m3 steps 2⁻⁹ there), rowwise scales each row by its own amax; the
    gradient's format (e5m2 against e4m3) and the per-column scales change dx too."""
    x, w, b, g = operands(1)
    x[3, 1, 7] = 2e5
    tensorwise, rowwise = run_function("tensorwise", x, w, b, g), run_function("rowwise", x, w, b, g)
    quiet = x.reshape(-1, 64).abs().amax(dim=1) < 10
    exact = x.reshape(-1, 64).float() @ w.float().t()
    err = {name: (out[0].reshape(-1, 48).float() - b.float() - exact).abs()[quiet].mean()
           for name, out in (("tensorwise", tensorwise), ("rowwise", rowwise))}
    assert err["rowwise"] < err["tensorwise"] / 4, err
    assert not torch.equal(tensorwise[1], rowwise[1])


def test_scaled_mm_on_cpu_dequantizes_then_multiplies_in_fp32():
    """The fact the references above stand on (docs/fp8.md, torch._scaled_mm on CPU): the operands dequantized with
    the given (inverse) scales, one fp32 matmul, one rounding to out_dtype; fp32 scales, one element each or a
    contiguous (m, 1) and (1, n); a 1-D scale refused."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(32, 64, generator=gen).to(E4M3)
    b = torch.randn(48, 64, generator=gen).to(E5M2)
    sa, sb = torch.tensor(1.37), torch.tensor(0.71)  # not powers of two: the order of the multiplications shows
    exact = (a.float() * sa) @ (b.float() * sb).t()
    assert torch.equal(torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.float32), exact)
    assert torch.equal(torch._scaled_mm(a, b.t(), sa, sb, out_dtype=torch.bfloat16), exact.bfloat16())
    rows, cols = torch.rand(32, 1, generator=gen) + 0.5, torch.rand(1, 48, generator=gen) + 0.5
    assert torch.equal(torch._scaled_mm(a, b.t(), rows, cols, out_dtype=torch.float32),
                       (a.float() * rows) @ (b.float() * cols.t()).t())
    with pytest.raises(ValueError, match="scale_a should be \\(32, 1\\)"):
        torch._scaled_mm(a, b.t(), rows.reshape(-1), cols.reshape(-1), out_dtype=torch.bfloat16)
    assert math.isclose(torch.finfo(E4M3).max, LARGEST[E4M3]) and math.isclose(torch.finfo(E5M2).max, LARGEST[E5M2])


@pytest.mark.one_core
def test_the_function_compiles_whole_and_computes_what_eager_does(monkeypatch):
    """model.compile: the FP8 linear function is torch ops in an autograd.Function, which torch.compile (inductor)
    traces into one graph (fullgraph: no break) whose forward and backward equal eager's to the bit (tensorwise here,
    through the weight's gathered-or-cast path; rowwise measured equal too, docs/fp8.md), eager casting in row blocks
    (operands over CAST_CHUNK) where the compiled casts never do. ~15 s of compilation."""
    import zero3d.float8 as float8
    from pretrain.model.fp8 import Float8LinearFunction
    from zero3d.float8 import RECIPES
    monkeypatch.setattr(float8, "CAST_CHUNK", 256)
    torch._dynamo.reset()
    x, w, b, g = operands(4)
    weight, bias = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())

    def linear(inputs):
        return Float8LinearFunction.apply(inputs, weight, bias, RECIPES["tensorwise"], False, False, None)

    def run(fn):
        inputs = x.clone().requires_grad_(True)
        weight.grad = bias.grad = None
        y = fn(inputs)
        y.backward(g)
        return y.detach(), inputs.grad, weight.grad, bias.grad
    eager = run(linear)
    compiled = run(torch.compile(linear, backend="inductor", fullgraph=True))
    for a, c in zip(eager, compiled):
        assert torch.equal(a, c)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_float8_values_come_only_from_casts(recipe, monkeypatch):
    """model.compile: in the graphs inductor lowers, every float8 value is a cast's output or a layout op on one,
    never a constant, an empty buffer or a scatter, even for operands eager casts in row blocks (over CAST_CHUNK).
    Triton builds no float8 constant: the blocks' writes, compiled, made `tl.full(..., tl.float8e5)` and failed on
    an H200 (docs/gpu-check.md)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.decomposition import select_decomp_table

    import zero3d.float8 as float8
    from pretrain.model.fp8 import Float8LinearFunction
    monkeypatch.setattr(float8, "CAST_CHUNK", 256)  # every operand here is over it: eager casts them in row blocks
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=record, bw_compiler=record, decompositions=select_decomp_table())
    x, w, b, g = operands(5)
    weight, bias = torch.nn.Parameter(w), torch.nn.Parameter(b)
    inputs = x.clone().requires_grad_(True)
    compiled = torch.compile(lambda t: Float8LinearFunction.apply(t, weight, bias, float8.RECIPES[recipe], False,
                                                                  False, None), backend=backend, fullgraph=True)
    compiled(inputs).backward(g)
    made = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"
            and isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].dtype in (E4M3, E5M2)}
    casts = {"prims.convert_element_type.default"}
    layout = {"aten.t.default", "aten.permute.default", "aten.clone.default", "aten.view.default",
              "aten._unsafe_view.default", "aten.reshape.default", "aten.transpose.int"}
    assert casts <= made and made <= casts | layout, made
