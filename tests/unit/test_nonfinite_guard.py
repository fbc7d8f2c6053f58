"""train.max_nonfinite_steps counts consecutive non-finite steps only: a finite step between two failures resets the
count, an fp16 overflow the loss scaler can still back off from is no failure, one at the minimum scale is."""
import math

import pytest

from pretrain.config import load_config
from pretrain.errors import NumericalError
from pretrain.runtime.stopping import NonfiniteGuard

INF, NAN = math.inf, math.nan


def guard(limit=2, dtype="fp32", min_scale=1.0):
    return NonfiniteGuard(load_config(None, [f"train.max_nonfinite_steps={limit}", f'precision.dtype="{dtype}"',
                                             f"precision.min_loss_scale={min_scale}"]))


def feed(g, steps):
    """steps: (loss, grad_norm, loss_scale) a step; returns the steps completed before NumericalError (or all)."""
    for step, (loss, norm, scale) in enumerate(steps):
        try:
            g.update(g.is_nonfinite(loss, norm, scale), step, loss, norm, "step_00000001")
        except NumericalError as err:
            return step, str(err)
    return len(steps), None


GOOD, BAD_LOSS, BAD_NORM = (2.5, 1.0, 1.0), (NAN, 1.0, 1.0), (2.5, INF, 1.0)


@pytest.mark.parametrize("pattern,stops_at", [
    ([BAD_LOSS, GOOD, BAD_NORM, GOOD, BAD_LOSS, GOOD], None),  # three failures, never two in a row
    ([BAD_LOSS, GOOD, BAD_NORM, BAD_LOSS], 3),                  # the second of two in a row stops
    ([GOOD, BAD_NORM, BAD_NORM, GOOD], 2),
], ids=["interleaved", "reset-then-streak", "streak"])
def test_a_finite_step_between_failures_resets_the_count(pattern, stops_at):
    step, message = feed(guard(limit=2), pattern)
    if stops_at is None:
        assert (step, message) == (len(pattern), None)
    else:  # the message names the streak's own steps, not the failures before the reset
        assert step == stops_at
        assert f"not finite for 2 consecutive steps (steps {stops_at - 1}-{stops_at}" in message


def test_the_limit_is_the_streak_length():
    assert feed(guard(limit=3), [BAD_NORM, BAD_NORM, GOOD, BAD_NORM, BAD_NORM, GOOD])[1] is None
    assert feed(guard(limit=3), [BAD_NORM, BAD_NORM, BAD_NORM])[0] == 2


def test_fp16_overflow_counts_only_at_the_minimum_loss_scale():
    """An fp16 step with an inf norm is the scaler's skip while the scale can still halve; at
    precision.min_loss_scale it can back off no further and counts. A non-finite loss always counts."""
    skip = (2.5, INF, 1024.0)
    assert feed(guard(limit=2, dtype="fp16"), [skip] * 6)[1] is None
    at_floor = (2.5, INF, 1.0)
    assert feed(guard(limit=2, dtype="fp16"), [skip, at_floor, skip, at_floor, at_floor])[0] == 4
    assert feed(guard(limit=2, dtype="fp16"), [(NAN, 1.0, 1024.0), (NAN, 1.0, 1024.0)])[0] == 1
    # bf16 and fp32 have no scaler: an inf norm counts whatever the recorded scale
    assert feed(guard(limit=2, dtype="bf16"), [skip, skip])[0] == 1
