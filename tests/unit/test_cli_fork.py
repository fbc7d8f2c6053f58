"""The tests' command runner (tests/cli_fork.py) reports each command's own exit status, even when the server it
was forked from dies meanwhile."""
import os
import sys

from cli_fork import run_python


def script(tmp_path, body: str) -> str:
    path = tmp_path / "command.py"
    path.write_text(body)
    return str(path)


def test_status_is_the_commands_own_when_its_server_dies(tmp_path):
    env = dict(os.environ)
    # The server's death reaches the runner at once; the command goes on for a second before it prints and ends
    # (under load, the suite once read its output in that gap: 255 and nothing printed).
    killer = script(tmp_path, "import os, signal, sys, time\nos.kill(os.getppid(), signal.SIGKILL)\ntime.sleep(1)\n"
                              "print('done')\nsys.exit(3)\n")
    out = run_python([killer], env, tmp_path, timeout=120)
    assert (out.returncode, out.stdout) == (3, "done\n"), out
    ok = run_python([script(tmp_path, "print('again')\n")], env, tmp_path, timeout=120)  # a new server
    assert (ok.returncode, ok.stdout) == (0, "again\n"), ok


def test_a_command_killed_by_a_signal_reports_the_signal(tmp_path):
    out = run_python([script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")],
                     dict(os.environ), tmp_path, timeout=120)
    assert out.returncode == -9, out
