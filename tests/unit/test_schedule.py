"""Learning-rate schedules (pretrain/schedule.py): every step against its formula, written out here."""
import math

import pytest

from pretrain.config import ConfigError, load_config
from pretrain.schedule import lr_at

LR, MIN, WARMUP, STEPS = 3e-3, 3e-4, 10, 100
BASE = [f"optimizer.lr={LR}", f"optimizer.min_lr={MIN}", f"optimizer.warmup_steps={WARMUP}", f"train.steps={STEPS}"]


def cfg_of(*overrides):
    return load_config(None, BASE + list(overrides))


def warmup(step):
    return LR * (step + 1) / WARMUP


def test_cosine_is_the_schedule_runs_had_before_bit_for_bit():
    """The default: the expression of the loop before schedules were a choice, so existing runs train as before."""
    cfg = cfg_of("optimizer.decay_steps=80")
    for step in range(STEPS):
        progress = min(1.0, (step - WARMUP) / (80 - WARMUP))
        legacy = warmup(step) if step < WARMUP else MIN + 0.5 * (LR - MIN) * (1.0 + math.cos(math.pi * progress))
        assert lr_at(step, cfg) == legacy, step


def test_linear_constant_and_inverse_sqrt_at_every_step():
    linear, constant, inv = (cfg_of(f'optimizer.schedule="{s}"') for s in ("linear", "constant", "inverse_sqrt"))
    for step in range(STEPS):
        if step < WARMUP:
            assert lr_at(step, linear) == lr_at(step, constant) == lr_at(step, inv) == warmup(step)
            continue
        # linear: from LR at the end of the warmup to MIN at train.steps, a straight line
        assert lr_at(step, linear) == pytest.approx(LR - (LR - MIN) * (step - WARMUP) / (STEPS - WARMUP), rel=1e-12)
        assert lr_at(step, constant) == LR
        # inverse square root: LR at the warmup's last step, LR·√(10/(step+1)) after, floored at MIN
        assert lr_at(step, inv) == pytest.approx(max(MIN, LR * math.sqrt(WARMUP / (step + 1))), rel=1e-12)
    assert lr_at(STEPS - 1, inv) > MIN  # √(10/100) · 3e-3 = 9.5e-4: the floor is not what the test sees
    assert lr_at(10**6, inv) == MIN


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_warms_up_holds_then_decays_over_its_last_fraction(shape):
    """90 steps after the warmup, a quarter of them (22.5 → 22) decaying: steps 10..77 at LR, 78..99 decaying
    to MIN at step 100 (train.steps), in the shape asked for."""
    cfg = cfg_of('optimizer.schedule="wsd"', "optimizer.decay_fraction=0.25", f'optimizer.decay_shape="{shape}"')
    start = STEPS - round(0.25 * (STEPS - WARMUP))
    assert start == 78
    left = {"linear": lambda p: 1 - p, "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
            "1-sqrt": lambda p: 1 - math.sqrt(p)}[shape]
    for step in range(STEPS + 5):
        if step < WARMUP:
            expected = warmup(step)
        elif step < start:
            expected = LR
        else:
            expected = MIN + (LR - MIN) * left(min(1.0, (step - start) / (STEPS - start)))
        assert lr_at(step, cfg) == pytest.approx(expected, rel=1e-12), step
    assert lr_at(STEPS, cfg) == MIN


@pytest.mark.parametrize("overrides, message", [
    (['optimizer.schedule="step"'], "optimizer.schedule"),
    (['optimizer.schedule="wsd"', "optimizer.decay_fraction=0"], "optimizer.decay_fraction = 0"),
    (['optimizer.schedule="wsd"', "optimizer.decay_fraction=1.5"], "optimizer.decay_fraction = 1.5 is invalid; must be in (0, 1]"),
    (['optimizer.schedule="wsd"', 'optimizer.decay_shape="exp"'], "optimizer.decay_shape"),
    (["optimizer.decay_fraction=0.1"], "optimizer.decay_fraction is set but optimizer.schedule = 'cosine' does not use it"),
    (['optimizer.schedule="linear"', 'optimizer.decay_shape="cosine"'],
     "optimizer.decay_shape is set but optimizer.schedule = 'linear' does not use it"),
])
def test_bad_schedule_settings_are_one_line_naming_the_value(overrides, message):
    with pytest.raises(ConfigError) as err:
        cfg_of(*overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("schedule", ["wsd-linear", "wsd-cosine", "wsd-1-sqrt", "cosine", "linear"])
def test_decay_steps_before_the_end_decays_to_min_lr_there_and_holds_it(schedule):
    """optimizer.decay_steps = 60 < train.steps = 100: the decay ends at step 60, not at train.steps, and min_lr holds
    from there to the run's end. WSD's decay is the last 0.3 of the 50 steps from the warmup to decay_steps (15):
    steps 10..44 at LR, 45..59 decaying; cosine and linear decay over steps 10..59."""
    name, _, shape = schedule.partition("-")
    keys = (['optimizer.schedule="wsd"', "optimizer.decay_fraction=0.3", f'optimizer.decay_shape="{shape}"']
            if name == "wsd" else [f'optimizer.schedule="{name}"'])
    cfg = cfg_of("optimizer.decay_steps=60", *keys)
    start = {"wsd": 45, "cosine": WARMUP, "linear": WARMUP}[name]
    left = {"linear": lambda p: 1 - p, "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
            "1-sqrt": lambda p: 1 - math.sqrt(p)}[shape or name]
    for step in range(STEPS + 5):
        if step < WARMUP:
            expected = warmup(step)
        elif step < start:
            expected = LR
        elif step < 60:
            expected = MIN + (LR - MIN) * left((step - start) / (60 - start))
        else:
            expected = MIN
        assert lr_at(step, cfg) == pytest.approx(expected, rel=1e-12), step
    assert lr_at(start - 1, cfg) == LR > lr_at(start + 1, cfg)  # the decay starts where the formula says


@pytest.mark.parametrize("keys", [[], ['optimizer.schedule="wsd"', "optimizer.decay_fraction=0.2"]], ids=["cosine", "wsd"])
def test_a_decay_of_no_steps_is_min_lr_from_decay_steps_on(keys):
    """Nothing left to decay over — cosine with decay_steps = warmup_steps = 10; WSD's 0.2 of the 2 steps between the
    warmup and decay_steps = 12, which rounds to none — is min_lr from decay_steps on, as after any decay."""
    decay_steps = 12 if keys else WARMUP
    cfg = cfg_of(f"optimizer.decay_steps={decay_steps}", *keys)
    assert [lr_at(step, cfg) for step in range(WARMUP - 1, decay_steps + 2)] == (
        [warmup(WARMUP - 1)] + [LR] * (decay_steps - WARMUP) + [MIN, MIN])
