"""The tests' command runner (tests/cli_fork.py) reports each command's own exit status, even when the server it
was forked from dies meanwhile."""
import os
import signal

from cli_fork import run_python, start_python


def script(tmp_path, body: str) -> str:
    path = tmp_path / "command.py"
    path.write_text(body)
    return str(path)


def test_status_is_the_commands_own_when_its_server_dies(tmp_path):
    """The test kills the server once the command runs (the command killing its own parent raced the server's report
    of the command's pid: under load the server could die first, an EOF at the start); the command then goes on a
    second before it prints and ends. The server's death reaches the runner at once (the suite once read the output
    in that gap: 255 and nothing printed)."""
    env = dict(os.environ)
    go = tmp_path / "go"
    command = script(tmp_path, "import os, sys, time\ndeadline = time.monotonic() + 100\n"
                               "while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:\n"
                               "    time.sleep(0.01)\ntime.sleep(1)\nprint('done')\nsys.exit(3)\n")
    started = start_python([command, str(go)], env, tmp_path)
    with open(f"/proc/{started.pid}/stat") as stat:
        server = int(stat.read().rsplit(")", 1)[1].split()[1])
    assert server not in (os.getpid(), 1)
    os.kill(server, signal.SIGKILL)
    go.touch()
    out = started.finish(timeout=120)
    assert (out.returncode, out.stdout) == (3, "done\n"), out
    ok = run_python([script(tmp_path, "print('again')\n")], env, tmp_path, timeout=120)  # a new server
    assert (ok.returncode, ok.stdout) == (0, "again\n"), ok


def test_a_command_killed_by_a_signal_reports_the_signal(tmp_path):
    out = run_python([script(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")],
                     dict(os.environ), tmp_path, timeout=120)
    assert out.returncode == -9, out
