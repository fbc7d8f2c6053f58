"""The docs tier's session fixtures: a scratch copy of the repository root and every marked command's result."""
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from doc_commands import REPO, documented_commands, run

WORKERS = 3  # subprocesses at once: most of each command is interpreter start-up and imports
LINKED = ("pretrain", "zero3d", "slurm", "megatron_patches", "data", "tools", "bench", "pyproject.toml")


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory) -> Path:
    """A working directory that looks like the repository root: code and data linked, configs/ copied
    (the generator resolves its default output from its own file, so even a regression writes here,
    never into the committed configs/paper), runs/ and results/ its own."""
    root = tmp_path_factory.mktemp("docs")
    for name in LINKED:
        (root / name).symlink_to(REPO / name)
    shutil.copytree(REPO / "configs", root / "configs", ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.fixture(scope="session")
def setup_result(sandbox):
    """(command, result) of the one command marked `setup`: the tiny run, made once per session."""
    setups = [c for c in documented_commands() if c.setup]
    assert len(setups) == 1, f"exactly one doc-test command is marked setup; found {[c.id for c in setups]}"
    return setups[0], run(setups[0], sandbox)


@pytest.fixture(scope="session")
def results(sandbox, setup_result) -> dict:
    """Every marked command's result, run once per session: the tiny run first, then the others
    WORKERS at a time (those reading the tiny run, `needs=tiny-run`, among them)."""
    commands = [c for c in documented_commands() if not c.setup]
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        done = dict(zip((c.id for c in commands), pool.map(lambda c: run(c, sandbox), commands)))
    done[setup_result[0].id] = setup_result[1]
    return done


@pytest.fixture(scope="session")
def tiny_run(setup_result, sandbox) -> Path:
    """The run directory the docs' setup command made (checked by its own test)."""
    setup, result = setup_result
    assert result.returncode == 0, result.stderr[-2000:]
    name = next(a.split("=", 1)[1] for a in setup.argv if a.startswith("logging.name="))
    return sandbox / "runs" / name
