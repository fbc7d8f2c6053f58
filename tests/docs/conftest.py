"""The docs tier's session fixtures: a scratch copy of the repository root and every marked command's result."""
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from doc_commands import REPO, documented_commands, run
from gpt2_files import write_gpt2_files

WORKERS = 3  # subprocesses at once: most of each command is interpreter start-up and imports
LINKED = ("pretrain", "zero3d", "analysis", "model_shape", "megatron_patches", "tools", "bench", "examples", "pyproject.toml")
# Copied, not linked: the generator and slurm/submit.py find the repository root from their own file (a link would
# resolve to the checkout), so the generator writes here and submit.py checks this root's data/ and runs/.
COPIED = ("configs", "slurm")


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory) -> Path:
    """A working directory that looks like the repository root: code and data files linked, configs/ and slurm/
    copied (COPIED: even a regression of the generator writes here, never into the committed configs/paper), runs/
    and results/ its own, and data/gpt2/ holding GPT-2-format stand-ins (tests/gpt2_files.py) for the vocab.json
    and merges.txt a user supplies for the paper configs."""
    root = tmp_path_factory.mktemp("docs")
    for name in LINKED:
        (root / name).symlink_to(REPO / name)
    (root / "data").mkdir()
    for entry in (REPO / "data").iterdir():
        if entry.name != "gpt2":
            (root / "data" / entry.name).symlink_to(entry)
    write_gpt2_files(root / "data" / "gpt2")
    for name in COPIED:
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
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
    WORKERS at a time (those reading the tiny run, `needs=tiny-run`, among them), then those that need a named
    command's output (`needs=<name>`: the HF export's directory, say)."""
    commands = [c for c in documented_commands() if not c.setup]
    names = {c.name for c in commands if c.name}
    unknown = [f"{c.id}: needs={c.needs}" for c in commands if c.needs not in ("", "tiny-run", *names)]
    assert not unknown, f"no doc-test command is named what these need: {unknown}"
    waves = [[c for c in commands if c.needs in ("", "tiny-run")], [c for c in commands if c.needs in names]]
    assert not any(c.name for c in waves[1]), "a command named for others runs in the first wave (needs nothing named)"
    done = {setup_result[0].id: setup_result[1]}
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        for wave in waves:
            done.update(zip((c.id for c in wave), pool.map(lambda c: run(c, sandbox), wave)))
    return done


@pytest.fixture(scope="session")
def tiny_run(setup_result, sandbox) -> Path:
    """The run directory the docs' setup command made (checked by its own test)."""
    setup, result = setup_result
    assert result.returncode == 0, result.stderr[-2000:]
    name = next(a.split("=", 1)[1] for a in setup.argv if a.startswith("logging.name="))
    return sandbox / "runs" / name
