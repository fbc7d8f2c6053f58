"""Test tiers: unit/ (one process, seconds), dist/ (forked gloo ranks), slurm/ (a real local Slurm)."""
from pathlib import Path

import pytest

import megatron_patches.lean  # noqa: F401  (test processes and their forked ranks import megatron-core lean)
import torch._dynamo  # noqa: F401,E402  (imported by every optimizer's first call: once here, not in each forked rank)

SLURM_TIER = Path(__file__).parent / "slurm"
DOCS_TIER = Path(__file__).parent / "docs"


def pytest_collection_modifyitems(config, items):
    """The Slurm tier waits on a scheduler (`waits`); the docs tier runs its commands one at a time (`one_core`):
    tools/run_suite.py runs both in the side lane."""
    for item in items:
        if SLURM_TIER in Path(item.fspath).parents:
            item.add_marker(pytest.mark.waits)
        elif DOCS_TIER in Path(item.fspath).parents:
            item.add_marker(pytest.mark.one_core)
