"""zero3d's own settings sections check themselves; the engine honours its seams and explicit group kinds."""
import re

import pytest
import torch
import torch.nn as nn

import zero3d
from optim.config import OptimizerConfig
from optim.spec import OptimizerConfigError
from pretrain.config import OptimizerConfig as RecipeOptimizer
from pretrain.config import PrecisionConfig, load_config
from pretrain.train import engine_settings
from zero3d.config import LossScaleConfig, ZeroConfigError
from zero3d.precision import LossScaler


@pytest.mark.parametrize("kwargs,message", [
    ({"lr": 0.0}, "optimizer.lr = 0.0 must be > 0"),
    ({"lr": float("nan")}, "optimizer.lr = nan is invalid; must be a finite number"),
    ({"beta2": 1.0}, "optimizer.beta2 = 1.0 is invalid; must be in [0, 1)"),
    ({"eps": 0.0}, "optimizer.eps = 0.0 is invalid; must be > 0"),
    ({"clip_grad": -1.0}, "optimizer.clip_grad = -1.0 must be >= 0 (0 disables)"),
    ({"weight_decay": -0.1}, "optimizer.weight_decay = -0.1 is invalid; must be >= 0"),
])
def test_optimizer_config_names_the_bad_value(kwargs, message):
    with pytest.raises(OptimizerConfigError, match=re.escape(message)):
        OptimizerConfig(**kwargs)


@pytest.mark.parametrize("kwargs,message", [
    ({"min_loss_scale": 0.0}, "precision.initial_loss_scale = 65536.0 must be >= precision.min_loss_scale = 0.0 > 0"),
    ({"initial_loss_scale": 0.5}, "precision.initial_loss_scale = 0.5 must be >= precision.min_loss_scale = 1.0"),
    ({"backoff_factor": 1.0}, "precision.backoff_factor = 1.0 must be in (0, 1)"),
    ({"growth_factor": 1.0}, "precision.growth_factor = 1.0 must be > 1"),
    ({"growth_interval": 0}, "precision.growth_interval = 0 must be >= 1"),
    ({"hysteresis": 0}, "precision.hysteresis = 0 must be >= 1"),
    ({"initial_loss_scale": float("inf")}, "precision.initial_loss_scale = inf is invalid; must be a finite number"),
])
def test_loss_scale_config_names_the_bad_value(kwargs, message):
    with pytest.raises(ZeroConfigError, match=re.escape(message)):
        LossScaleConfig(**kwargs)


def test_loss_scaler_runs_on_its_config():
    """Traced by hand: hysteresis 2 backs off on every second overflow, never below the floor; two clean
    steps grow the scale by growth_factor."""
    scaler = LossScaler(LossScaleConfig(initial_loss_scale=8.0, min_loss_scale=2.0, growth_interval=2,
                                        backoff_factor=0.5, hysteresis=2, growth_factor=4.0))
    scales = []
    for overflow in (True, True, True, True, True, True, False, False):
        scaler.update(overflow)
        scales.append(scaler.scale)
    assert scales == [8.0, 4.0, 4.0, 2.0, 2.0, 2.0, 2.0, 8.0]


def test_pretrain_embeds_zero3d_sections_and_passes_them_through():
    assert issubclass(RecipeOptimizer, OptimizerConfig) and issubclass(PrecisionConfig, LossScaleConfig)
    cfg = load_config("configs/tiny.toml", ["precision.dtype=\"fp16\"", "precision.hysteresis=3"])
    settings = engine_settings(cfg)
    assert settings.optimizer is cfg.optimizer and settings.loss_scale is cfg.precision
    assert settings.optimizer.betas == (0.9, 0.95) and settings.loss_scale.hysteresis == 3
    assert settings.optimizer_spec.name == "adamw"
    assert engine_settings(load_config("configs/tiny.toml", ["optimizer.name=muon"])).optimizer_spec.name == "muon"
    assert engine_settings(load_config("configs/tiny.toml")).loss_scale is None  # fp32: no scaler


@pytest.mark.parametrize("stage", [0, 2])
def test_engine_builds_its_optimizer_and_reads_the_norm_through_its_seams(world, stage):
    """The optimizer gets each group's master with the weight decay its kind says (the Linear's 4×3 matrix
    decays; its bias and the LayerNorm's two vectors, 3 + 3 + 3 elements, do not), the named spec and its keys, and
    its fused kernels where the seam asks; a host read answering inf makes the step an overflow: skipped,
    parameters unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    settings = zero3d.EngineSettings(zero=zero3d.ZeroConfig(stage=stage),
                                     optimizer=OptimizerConfig(name="lion", lr=0.5, weight_decay=0.25, beta2=0.9),
                                     fused_optimizer=True,
                                     read_host_floats=lambda values: [float("inf")] * values.numel())
    engine = zero3d.wrap_model(model, settings, zero3d.ParallelGroups(dp_group=None))
    built = [(group["params"][0].numel(), group["weight_decay"]) for group in engine.optimizer.param_groups]
    assert built == [(12, 0.25), (9, 0.0)]
    assert engine.optimizer.spec.name == "lion" and engine.optimizer.hyper.beta2 == 0.9 and engine.optimizer.fused
    before = [p.detach().clone() for p in model.parameters()]
    engine.backward(engine(torch.randn(2, 4)).pow(2).sum())
    result = engine.step(0.5)
    assert result.skipped and result.grad_norm == float("inf")
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("overflow", [False, True], ids=["finite", "overflow"])
def test_step_sums_ride_in_the_norm_read(world, stage, overflow):
    """`step(lr, sums=...)` reads the host once: the seam gets one fp64 vector [squared norm, sums...]; the
    norm is that of autograd's own gradients of an unwrapped copy, the sums come back as given (a world of
    one rank), also on a step skipped for overflow (an inf in the gradient)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    twin = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    twin.load_state_dict(model.state_dict())
    reads = []

    def read(values):
        reads.append(values.detach().clone())
        return values.tolist()

    settings = zero3d.EngineSettings(zero=zero3d.ZeroConfig(stage=stage), read_host_floats=read)
    engine = zero3d.wrap_model(model, settings, zero3d.ParallelGroups(dp_group=None))
    x = torch.randn(2, 4)
    if overflow:
        x[0, 0] = float("inf")
    engine.backward(engine(x).pow(2).sum())
    twin(x).pow(2).sum().backward()
    sums = torch.tensor([0.1, 2.5], dtype=torch.float32)
    result = engine.step(0.1, sums=sums)
    assert len(reads) == 1 and reads[0].dtype == torch.float64 and reads[0].numel() == 3
    assert result.sums == (float(sums[0].double()), 2.5)
    expected = sum(p.grad.double().pow(2).sum() for p in twin.parameters()).sqrt().item()
    assert result.skipped == overflow
    if overflow:
        assert result.grad_norm == float("inf")
    else:
        assert result.grad_norm == pytest.approx(expected, rel=1e-6)  # fp32 block norms (engine.sum_of_squares)
    assert engine.step(0.1).sums == ()  # no sums: the read is the squared norm alone
    assert reads[1].numel() == 1


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_closed_engine_is_freed_with_its_buffers(world, stage):
    """close() removes the hooks the engine put on the model (each holds the engine, through autograd's C++ state
    the garbage collector cannot walk): then nothing holds the engine, and its fp32 masters go with it. A second
    engine in one process (bench/bench_gpu.py's rows measured 21 GB of the first one still held on an H200)
    starts from the memory the first had."""
    import gc
    import weakref
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    engine = zero3d.wrap_model(model, zero3d.EngineSettings(zero=zero3d.ZeroConfig(stage=stage)),
                               zero3d.ParallelGroups(dp_group=None))
    engine.backward(engine(torch.randn(2, 64)).pow(2).sum())
    engine.step(1e-3)
    masters = [weakref.ref(piece) for g in engine.groups.values() for _, piece in g.master_pieces]
    assert masters
    freed = weakref.ref(engine)
    engine.close()
    del engine
    gc.collect()
    assert freed() is None and all(master() is None for master in masters)


def test_stage_2_delivers_the_last_micro_batchs_reductions_before_the_next_forward(world):
    """Accumulating micro-batches at stage 2: the buckets still reducing at the end of one backward (the embedding's
    is the size of its gradient: 1.13 GB on the Llama-3 8B slice) are delivered before the next forward, not held
    through it; the step's gradient is the sum of both micro-batches'."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    twin = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64))
    twin.load_state_dict(model.state_dict())
    settings = zero3d.EngineSettings(zero=zero3d.ZeroConfig(stage=2, bucket_elements=64))
    engine = zero3d.wrap_model(model, settings, zero3d.ParallelGroups(dp_group=None))
    in_flight = []
    model.register_forward_pre_hook(lambda module, args: in_flight.append(len(engine.buckets.in_flight)))
    xs = [torch.randn(2, 64) for _ in range(2)]
    for x in xs:
        engine.backward(engine(x).pow(2).sum())
        twin(x).pow(2).sum().backward()
    assert in_flight == [0, 0] and engine.buckets.in_flight  # the second backward's last buckets: reduced by step()
    result = engine.step(0.0)
    expected = sum(p.grad.double().pow(2).sum() for p in twin.parameters()).sqrt().item()
    assert result.grad_norm == pytest.approx(expected, rel=1e-6)
