"""The docs tier: every command README.md, slurm/README.md and docs/*.md mark runnable runs, exits as marked
and prints its key line (a doc edit changes the test; a behaviour change fails it)."""
import os
import subprocess
import sys
from pathlib import Path

from concurrent.futures import ThreadPoolExecutor

import pytest

from doc_commands import REPO, DocTestError, documented_commands, extract

COMMANDS = documented_commands()
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_NODELIST", "ZERO3D_DEBUG")
WORKERS = 3  # subprocesses at once: most of each command is interpreter start-up and imports
LINKED = ("pretrain", "zero3d", "slurm", "megatron_patches", "data", "tools", "bench", "pyproject.toml")


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory) -> Path:
    """A working directory that looks like the repository root: code and data linked, configs/ a real
    directory of links (so a generator writing configs/<new> lands here), runs/ and results/ its own."""
    root = tmp_path_factory.mktemp("docs")
    for name in LINKED:
        (root / name).symlink_to(REPO / name)
    (root / "configs").mkdir()
    for child in (REPO / "configs").iterdir():
        (root / "configs" / child.name).symlink_to(child)
    return root


def run(cmd, cwd: Path) -> subprocess.CompletedProcess:
    argv = list(cmd.argv)
    if argv[0] in ("python", "python3", ".venv/bin/python"):
        argv[0] = sys.executable
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS} | {"WANDB_MODE": "offline"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def check(cmd, out: subprocess.CompletedProcess) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == cmd.exit, f"{cmd.id}: `{cmd.text}` exited {out.returncode}, the doc says {cmd.exit}\n{text[-3000:]}"
    for line in cmd.expect:
        assert line in text, f"{cmd.id}: `{cmd.text}` did not print {line!r}\n{text[-3000:]}"


@pytest.fixture(scope="session")
def results(sandbox) -> dict:
    """Every marked command's result, run once per session: the independent ones and the tiny run
    (marked `setup`) side by side, then the ones that read the tiny run (`needs=tiny-run`) in doc order."""
    setups = [c for c in COMMANDS if c.setup]
    assert len(setups) == 1, f"exactly one doc-test command is marked setup; found {[c.id for c in setups]}"
    first = [c for c in COMMANDS if not c.needs]
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        done = dict(zip((c.id for c in first), pool.map(lambda c: run(c, sandbox), first)))
    for cmd in (c for c in COMMANDS if c.needs):
        done[cmd.id] = run(cmd, sandbox)
    return done


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_documented_command(cmd, results):
    if cmd.needs:
        (setup,) = [c for c in COMMANDS if c.setup]
        check(setup, results[setup.id])
    check(cmd, results[cmd.id])


def test_every_doc_with_commands_marks_some_and_markers_parse():
    by_source = {c.source for c in COMMANDS}
    assert {"README.md", "slurm/README.md", "docs/estimator.md"} <= by_source
    assert len(COMMANDS) >= 15


def test_markers_are_checked():
    good = '<!-- doc-test: exit=2 expect="a b" expect="c" -->\n```bash\npython x.py --y \\\n  --z  # comment\n```\n'
    (cmd,) = extract("doc.md", good)
    assert (cmd.exit, cmd.expect, cmd.argv, cmd.line) == (2, ["a b", "c"], ["python", "x.py", "--y", "--z"], 3)
    with pytest.raises(DocTestError, match="doc.md:1: a doc-test block holds exactly one command; found 2"):
        extract("doc.md", "<!-- doc-test: exit=0 -->\n```bash\na\nb\n```\n")
    with pytest.raises(DocTestError, match="unknown doc-test attribute 'exitcode'"):
        extract("doc.md", "<!-- doc-test: exitcode=0 -->\n```bash\na\n```\n")
    with pytest.raises(DocTestError, match="followed directly by a fenced block"):
        extract("doc.md", "<!-- doc-test: exit=0 -->\ntext\n```bash\na\n```\n")
