"""Extracts the commands the docs mark runnable (`<!-- doc-test: ... -->` before a fenced block)."""
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from cli_fork import run_python

REPO = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "slurm/README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*doc-test:(.*?)-->\s*$")
ATTRIBUTE = re.compile(r"""(\w+)(?:=(?:"([^"]*)"|'([^']*)'|([^\s"']+)))?""")
KNOWN = {"exit", "expect", "setup", "needs", "name"}


class DocTestError(ValueError):
    """A doc-test marker or its block is malformed; the message names the file and line."""


@dataclass
class DocCommand:
    """One marked command: where it is, its argv, the exit code and the lines its output must contain."""

    source: str
    line: int
    text: str
    argv: list
    exit: int = 0
    expect: list = field(default_factory=list)
    setup: bool = False  # the command that makes the tiny run the others read
    needs: str = ""  # "tiny-run": run after the setup command; another command's `name`: after that one
    name: str = ""  # what a later command's `needs` calls this one

    @property
    def id(self) -> str:
        return f"{self.source}:{self.line}"


def _attributes(text: str, where: str) -> dict:
    out = {"expect": []}
    for key, double, single, bare in ATTRIBUTE.findall(text):
        if key not in KNOWN:
            raise DocTestError(f"{where}: unknown doc-test attribute {key!r}; valid: {', '.join(sorted(KNOWN))}")
        value = double or single or bare
        if key == "expect":
            out["expect"].append(value)
        elif key == "exit":
            out["exit"] = int(value)
        elif key == "setup":
            out["setup"] = True
        else:
            out[key] = value
    return out


def _one_command(block: list, where: str) -> tuple:
    """The block's lines → (text, argv): continuation lines joined, comments dropped; exactly one command."""
    joined, commands = "", []
    for raw in block:
        joined += raw.rstrip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        argv = shlex.split(joined, comments=True)
        if argv:
            commands.append((" ".join(joined.split("#")[0].split()), argv))
        joined = ""
    if len(commands) != 1:
        raise DocTestError(f"{where}: a doc-test block holds exactly one command; found {len(commands)}")
    return commands[0]


def extract(source: str, text: str) -> list:
    """Every marked command of one markdown text, in document order."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        m = MARKER.match(lines[i].strip())
        if not m:
            i += 1
            continue
        where = f"{source}:{i + 1}"
        attrs = _attributes(m.group(1), where)
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise DocTestError(f"{where}: a doc-test marker must be followed directly by a fenced block")
        end = next((j for j in range(i + 2, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise DocTestError(f"{where}: the fenced block after the marker is not closed")
        cmd_text, argv = _one_command(lines[i + 2:end], where)
        found.append(DocCommand(source, i + 3, cmd_text, argv, **attrs))
        i = end + 1
    return found


def documented_commands(root: Path = REPO) -> list:
    return [c for name in DOCS for c in extract(name, (root / name).read_text())]


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_NODELIST", "ZERO3D_DEBUG")


def run(cmd: DocCommand, cwd: Path) -> subprocess.CompletedProcess:
    """The command as written, from `cwd`, launcher variables unset; `python` is this interpreter, its module or
    script run as `__main__` in a fork of a server that imported torch and megatron once (tests/cli_fork.py)."""
    argv = list(cmd.argv)
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS} | {"WANDB_MODE": "offline"}
    if argv[0] in ("python", "python3", ".venv/bin/python"):
        return run_python(argv[1:], env, cwd, timeout=240)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def check(cmd: DocCommand, out: subprocess.CompletedProcess) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == cmd.exit, f"{cmd.id}: `{cmd.text}` exited {out.returncode}, the doc says {cmd.exit}\n{text[-3000:]}"
    for line in cmd.expect:
        assert line in text, f"{cmd.id}: `{cmd.text}` did not print {line!r}\n{text[-3000:]}"
    if cmd.exit not in (0, 1):  # a known error is its one line (docs/exit-codes.md): never a traceback
        assert "Traceback" not in text, f"{cmd.id}: `{cmd.text}` printed a traceback\n{text[-3000:]}"
