"""The dist tier's reference runs, computed once per session and shared by every test (and module) asking
for the same (world, overrides, steps): stage 0 references recur across test_zero.py and test_stage3.py."""
import functools

import pytest

from gpt_harness import run_gpt_steps
from ranks import run_ranks


@functools.lru_cache(maxsize=None)
def _gpt_run(world: int, overrides: tuple, steps: int, inject_inf_at=None) -> list:
    return run_ranks(run_gpt_steps, world, list(overrides), steps, inject_inf_at, timeout=300)


@pytest.fixture(scope="session")
def gpt_run():
    """gpt_run(world, overrides, steps, inject_inf_at=None) -> per-rank results of tests/gpt_harness.py's
    run_gpt_steps; cached (callers must not mutate the results)."""
    return lambda world, overrides, steps, inject_inf_at=None: _gpt_run(world, tuple(overrides), steps, inject_inf_at)
