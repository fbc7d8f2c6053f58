"""The named optimizers (optim/): each one's update against its published rule written out here, bf16 states
(the update in fp32, the states rounded back), and the [optimizer] keys each one owns."""
import math
import re

import pytest
import torch

from optim import SPECS, spec_named
from optim.config import OptimizerConfig
import optim.flat_optimizer
from optim.flat_optimizer import FlatOptimizer, FlatTensor
from optim.spec import STEP_CHUNK
from optim.spec import OptimizerConfigError
from pretrain.config import ConfigError, load_config

SIZES = (1000, 37, 4096)  # three pieces, two weight decays (as the engine's groups), odd sizes
DECAYS = (0.1, 0.0, 0.1)
LR = 1e-2


def pieces(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in SIZES]


def grads(step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(n, generator=g) for n in SIZES]


def flat_run(name, steps=4, state_dtype="fp32", fused=False, **keys):
    """The engine's optimizer over the pieces, one step a gradient draw."""
    masters = pieces()
    config = OptimizerConfig(name=name, lr=LR, state_dtype=state_dtype, **keys)
    opt = FlatOptimizer([FlatTensor(m, wd) for m, wd in zip(masters, DECAYS)], spec_named(name), config, fused=fused)
    for step in range(steps):
        for m, g in zip(masters, grads(step)):
            m.grad = g
        opt.step()
    return masters, opt


# ------------------------------------------------------------ each update against its published rule


def test_adamw_is_torchs_single_tensor_adamw_bit_for_bit_and_its_fused_kernel_within_rounding():
    """The foreach kernels (the CPU device path) give the single-tensor loop's bits (the engine's update before the
    spec had kernels); torch's fused kernel (a GPU's path; here its CPU build) rounds apart by ulps."""
    ref = pieces()
    opt = torch.optim.AdamW([{"params": [m], "weight_decay": wd} for m, wd in zip(ref, DECAYS)], lr=LR,
                            betas=(0.9, 0.999), eps=1e-8, foreach=False)
    for step in range(4):
        for m, g in zip(ref, grads(step)):
            m.grad = g
        opt.step()
    foreach, flat = flat_run("adamw")
    fused, _ = flat_run("adamw", fused=True)
    for r, a, b in zip(ref, foreach, fused):
        assert torch.equal(a, r)
        torch.testing.assert_close(b, r, rtol=1e-6, atol=1e-7)
    assert flat.step_count([foreach[0]]) == 4


def test_lion_is_the_papers_rule():
    """Chen et al. 2023, Algorithm 2: c = β1·m + (1 − β1)·g; θ ← θ − lr·(sign(c) + λ·θ); m ← β2·m + (1 − β2)·g."""
    b1, b2 = 0.9, 0.99
    ref = [p.double() for p in pieces()]
    momenta = [torch.zeros_like(p) for p in ref]
    for step in range(4):
        for p, m, g, wd in zip(ref, momenta, grads(step), DECAYS):
            g = g.double()
            c = b1 * m + (1 - b1) * g
            p -= LR * (torch.sign(c) + wd * p)
            m.mul_(b2).add_((1 - b2) * g)
    out, opt = flat_run("lion", beta2=b2)
    for r, a, m in zip(ref, out, momenta):
        torch.testing.assert_close(a.double(), r, rtol=0, atol=1e-6)  # fp32 against fp64: 4 steps of ±lr
        torch.testing.assert_close(opt.state[a]["momentum"].double(), m, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_is_torchs_sgd_with_momentum(nesterov):
    ref = pieces()
    opt = torch.optim.SGD([{"params": [m], "weight_decay": wd} for m, wd in zip(ref, DECAYS)], lr=LR, momentum=0.9,
                          nesterov=nesterov, foreach=False)
    for step in range(4):
        for m, g in zip(ref, grads(step)):
            m.grad = g
        opt.step()
    out, _ = flat_run("sgd", momentum=0.9, nesterov=nesterov)
    for r, a in zip(ref, out):
        torch.testing.assert_close(a, r, rtol=0, atol=1e-7)


def keller_newton_schulz(G, steps=5):
    """K. Jordan's zeropower_via_newtonschulz5 (modded-nanogpt), in fp32: the reference Muon's orthogonalization."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.float()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


@pytest.mark.parametrize("shape", [(24, 10), (10, 24)], ids=["tall", "wide"])
def test_muon_step_of_one_whole_matrix_is_the_published_rule(shape):
    """Muon's matrix rule through the optimizer, the engine's exchange stood in for by the whole matrix itself:
    b ← μb + g, U = g + μb (Nesterov), W ← W(1 − lr·λ) − lr·0.2·√max(rows, cols)·NS5(U) (Moonshot's scale)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(shape, generator=g)
    ref, buf = w.clone(), torch.zeros(shape)
    master = w.clone().view(-1)
    config = OptimizerConfig(name="muon", lr=LR, weight_decay=0.1)
    hyper = config.hyper

    def whole(items):  # every piece is a whole matrix here
        return [spec_named("muon").matrix.transform(d.view(shape), hyper).view(-1) for _, _, d in items]

    opt = FlatOptimizer([FlatTensor(master, 0.1, "matrix", 0, matrix=True)], spec_named("muon"), config, fused=False,
                        orthogonalize=whole)
    for step in range(3):
        grad = torch.randn(shape, generator=g)
        buf = 0.95 * buf + grad
        update = keller_newton_schulz(grad + 0.95 * buf) * 0.2 * math.sqrt(max(shape))
        ref = ref * (1 - LR * 0.1) - LR * update
        master.grad = grad.reshape(-1)
        opt.step()
    torch.testing.assert_close(master.view(shape), ref, rtol=1e-5, atol=1e-6)
    assert (ref - w).abs().max() > 10 * 1e-6  # it moved by far more than the tolerance
    assert list(opt.state[master]) == ["step", "momentum_buffer"] and opt.step_count([master]) == 3


# ------------------------------------------------------------ bf16 states


@pytest.mark.parametrize("name", ["adamw", "lion", "sgd"])
def test_bf16_states_are_bf16_and_the_update_is_the_fp32_one_rounded_back(name):
    """Each step with bf16 states = the fp32 update from the upcast states, the new states rounded to nearest bf16:
    the reference steps an fp32 optimizer from the same upcast states each step and rounds them itself."""
    keys = {"sgd": {"momentum": 0.9}}.get(name, {})
    out, opt = flat_run(name, steps=1, state_dtype="bf16", **keys)
    ref, ref_opt = flat_run(name, steps=1, state_dtype="fp32", **keys)
    for step in range(1, 4):
        for p, r in zip(out, ref):
            for key in spec_named(name).states:
                assert opt.state[p][key].dtype == torch.bfloat16
                ref_opt.state[r][key].copy_(ref_opt.state[r][key].bfloat16())  # what bf16 storage keeps
        for p, r, g in zip(out, ref, grads(step)):
            p.grad, r.grad = g, g.clone()
        opt.step()
        ref_opt.step()
    for p, r in zip(out, ref):
        assert torch.equal(p, r)
        for key in spec_named(name).states:
            assert torch.equal(opt.state[p][key], ref_opt.state[r][key].bfloat16())
    assert opt.step_count([out[0]]) == 4


def test_bf16_states_are_upcast_a_chunk_at_a_time():
    """A piece longer than STEP_CHUNK steps as the same piece stepped whole (the chunks are elementwise slices)."""
    n = STEP_CHUNK + 5
    g = torch.Generator().manual_seed(1)
    master, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    config = OptimizerConfig(lr=LR, state_dtype="bf16")
    opt = FlatOptimizer([FlatTensor(master, 0.1)], spec_named("adamw"), config, fused=False)
    whole = master.clone()
    states = {k: torch.zeros(n) for k in ("exp_avg", "exp_avg_sq")}
    from torch.optim.adamw import adamw
    adamw([whole], [grad], [states["exp_avg"]], [states["exp_avg_sq"]], [], [torch.tensor(0.0)], foreach=True,
          amsgrad=False, beta1=0.9, beta2=0.999, lr=LR, weight_decay=0.1, eps=1e-8, maximize=False)
    master.grad = grad
    opt.step()
    assert torch.equal(master, whole)
    assert torch.equal(opt.state[master]["exp_avg_sq"], states["exp_avg_sq"].bfloat16())


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["adamw", "lion", "sgd", "muon"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compute_dtype_gradients_step_as_their_scaled_fp32_copies(monkeypatch, dtype, name, state_dtype):
    """The device placement's step: gradients handed in the compute dtype with their scales (fp16's unscale, then the
    clip coefficient), cast a STEP_CHUNK at a time (here 300 elements: the 1000- and 4096-element pieces in chunks,
    the 37-element one in a run with its neighbours' chunks), step bit for bit as the fp32 copies the engine made
    before, scaled whole in the same order; Muon's matrix (a 24 × 50 piece) through its direction too."""
    monkeypatch.setattr(optim.flat_optimizer, "STEP_CHUNK", 300)
    g = torch.Generator().manual_seed(5)
    shapes = [(1000,), (37,), (4096,)] + ([(24, 50)] if name == "muon" else [])
    unscale, coef = (1 / 1024, 0.37)
    config = OptimizerConfig(name=name, lr=LR, state_dtype=state_dtype, weight_decay=0.1)

    def whole(items):
        return [spec_named(name).matrix.transform(d.view(24, 50), config.hyper).view(-1) for _, _, d in items]

    runs = []
    for handed in (False, True):
        masters = [torch.randn(shape, generator=torch.Generator().manual_seed(i)).view(-1)
                   for i, shape in enumerate(shapes)]
        opt = FlatOptimizer([FlatTensor(m, wd, matrix=len(shape) == 2) for m, shape, wd
                             in zip(masters, shapes, (0.1, 0.0, 0.1, 0.1))], spec_named(name), config, fused=False,
                            orthogonalize=whole if name == "muon" else None)
        draws = torch.Generator().manual_seed(7)
        for _ in range(3):
            low = [(torch.randn(m.numel(), generator=draws) * 1024).to(dtype) for m in masters]
            if handed:
                opt.step(grads={m: (x, (unscale, coef)) for m, x in zip(masters, low)})
            else:
                for m, x in zip(masters, low):
                    m.grad = x.float().mul_(unscale).mul_(coef)
                opt.step()
        runs.append((masters, opt))
    (ref, ref_opt), (got, got_opt) = runs
    for r, m in zip(ref, got):
        assert torch.equal(m, r)
        for key, value in ref_opt.state[r].items():
            assert torch.equal(got_opt.state[m][key], value), key
    assert not torch.equal(got[0], torch.randn(1000, generator=torch.Generator().manual_seed(0)))  # it stepped


def test_step_batches_cut_runs_at_the_limit():
    """Consecutive runs of at most the limit; an item past it alone; none empty."""
    from optim.spec import step_batches
    assert step_batches([3, 3, 3, 5, 1, 9, 2], 6) == [[0, 1], [2], [3, 4], [5], [6]]
    assert step_batches([], 6) == []


# ------------------------------------------------------------ the keys each optimizer owns


def test_state_bytes_per_parameter_of_each_spec():
    """K less the master: AdamW two moments, Lion one, SGD one buffer, Muon one buffer on its matrices and AdamW's
    two moments elsewhere; 4 bytes each in fp32, 2 in bf16."""
    moments = {"adamw": (2, 2), "lion": (1, 1), "sgd": (1, 1), "muon": (2, 1)}  # (elementwise, matrix) states
    for name, (elementwise, matrix) in moments.items():
        spec = SPECS[name]
        for dtype, size in (("fp32", 4), ("bf16", 2)):
            assert spec.bytes_per_element(False, dtype) == elementwise * size
            assert spec.bytes_per_element(True, dtype) == (matrix if spec.matrix else elementwise) * size


@pytest.mark.parametrize("kwargs,message", [
    ({"name": "adam"}, "optimizer.name = 'adam' is invalid; valid values: 'adamw', 'lion', 'sgd', 'muon'"),
    ({"state_dtype": "fp16"}, "optimizer.state_dtype = 'fp16' is invalid; valid values: 'fp32', 'bf16'"),
    ({"name": "sgd", "momentum": 1.0}, "optimizer.momentum = 1.0 is invalid; must be in [0, 1)"),
    ({"name": "muon", "ns_steps": 0}, "optimizer.ns_steps = 0 is invalid; must be an integer >= 1"),
    ({"name": "lion", "beta1": -0.1}, "optimizer.beta1 = -0.1 is invalid; must be in [0, 1)"),
    ({"name": "sgd", "beta2": 0.9}, "optimizer.beta2 is set but optimizer.name = 'sgd' does not use it (it belongs "
                                    "to adamw, lion, muon); remove it or set optimizer.name to one of them"),
    ({"momentum": 0.9}, "optimizer.momentum is set but optimizer.name = 'adamw' does not use it (it belongs to sgd, "
                        "muon)"),
    ({"name": "lion", "eps": 1e-6}, "optimizer.eps is set but optimizer.name = 'lion' does not use it (it belongs "
                                    "to adamw, muon)"),
    ({"name": "sgd", "ns_steps": 3}, "optimizer.ns_steps is set but optimizer.name = 'sgd' does not use it (it "
                                     "belongs to muon)"),
])
def test_each_optimizer_checks_its_keys_and_refuses_anothers(kwargs, message):
    with pytest.raises(OptimizerConfigError, match=re.escape(message)):
        OptimizerConfig(**kwargs)


def test_unset_keys_take_each_optimizers_defaults():
    assert OptimizerConfig(name="sgd").hyper.momentum == 0.9 and not OptimizerConfig(name="sgd").hyper.nesterov
    muon = OptimizerConfig(name="muon").hyper
    assert (muon.momentum, muon.nesterov, muon.ns_steps) == (0.95, True, 5)


def test_the_recipe_refuses_another_optimizers_key_even_at_its_default():
    """pretrain knows what the TOML and the overrides gave: beta2 = 0.95 is the recipe's default, given anyway."""
    with pytest.raises(ConfigError, match=re.escape("optimizer.beta2 is set but optimizer.name = 'sgd' does not use")):
        load_config("configs/tiny.toml", ["optimizer.name=sgd", "optimizer.beta2=0.95"])
    assert load_config("configs/tiny.toml", ["optimizer.name=sgd"]).optimizer.hyper.momentum == 0.9
    with pytest.raises(ConfigError, match="optimizer.name = 'muon' with zero.offload_optimizer = 'nvme' is not "
                                          "supported"):
        load_config("configs/tiny.toml", ["optimizer.name=muon", "zero.offload_optimizer=nvme", "zero.nvme_path=/tmp"])


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_the_engine_on_cpu_steps_adamw_as_torchs_single_tensor_loop(world, stage):
    """On CPU the engine's AdamW runs the foreach kernels (not the fused CPU kernel, which rounds apart): a small model
    wrapped at stages 0, 1 and 3 ends bit for bit where torch.optim.AdamW(foreach=False) takes its twin."""
    import copy

    import torch.nn as nn

    import zero3d
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 4))
    twin = copy.deepcopy(model)
    engine = zero3d.wrap_model(model, zero3d.EngineSettings(zero=zero3d.ZeroConfig(stage=stage),
                                                            optimizer=OptimizerConfig(lr=LR, weight_decay=0.1)),
                               zero3d.ParallelGroups(dp_group=None))
    opt = torch.optim.AdamW([{"params": [p for p in twin.parameters() if p.dim() > 1], "weight_decay": 0.1},
                             {"params": [p for p in twin.parameters() if p.dim() <= 1], "weight_decay": 0.0}],
                            lr=LR, foreach=False)
    x = torch.randn(4, 8)
    for _ in range(3):
        engine.backward(engine(x).pow(2).sum())
        engine.step(LR)
        twin(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    params = engine.gathered_parameters() if stage == 3 else dict(model.named_parameters())
    assert all(torch.equal(params[name], p) for name, p in twin.named_parameters())
