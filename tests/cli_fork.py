"""`python -m MODULE ARGS` or `python SCRIPT ARGS` run as the command runs, forked from a server that imported
torch and megatron once.

A fresh interpreter spends ~5 s of CPU importing them before the first line of a one-step run; the
forkserver process (multiprocessing's, preloading this module) pays that once per test process. Each run is
a fork of that clean server, never of pytest's process: the module or script executes as `__main__` (e.g.
`pretrain/__main__.py` with its warning filters and signal mask) with the arguments, environment and working
directory given (a script's folder first on sys.path, as the interpreter puts it), its stdout and stderr
written to files, its exit status returned. The modules a command runs as `__main__` are not preloaded.
"""
import multiprocessing as mp
import multiprocessing.forkserver
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings

with warnings.catch_warnings():  # megatron's import-time warnings (apex / Transformer Engine absent): not a run's
    warnings.simplefilter("ignore")
    import pretrain.train  # noqa: F401
    import torch._dynamo  # noqa: F401  (the optimizer's first step imports it)

_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["cli_fork"])
_ENVIRON = threading.Lock()  # the docs tier runs commands from several threads; PYTHONPATH is set around a start


def _start_server() -> None:
    """The server started with this folder importable (Python 3.11's forkserver ignores the parent's sys.path and
    skips a preload it cannot import: every run would import torch again)."""
    with _ENVIRON:
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(__file__), before) if p)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.pop("PYTHONPATH") if before is None else os.environ.update(PYTHONPATH=before)


def _child(args, env, cwd, out_path, err_path, status_path):
    import runpy
    code = 1
    try:
        for fd, path in ((1, out_path), (2, err_path)):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout = open(1, "w", closefd=False, buffering=1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int) and stop.code is not None:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what an interpreter prints for an uncaught exception
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        with open(status_path, "w") as status:  # the status as the command ended, whatever becomes of the server
            status.write(str(code))
        os._exit(code)


def _start(proc) -> None:
    """proc started on the server; a server found dead is started anew (one that has just died can still look
    alive for a moment: its socket then refuses, and the next look sees it gone)."""
    for _ in range(50):
        _start_server()
        try:
            return proc.start()
        except ConnectionRefusedError:
            time.sleep(0.2)
    proc.start()


def exit_status(status_path: str, exitcode: int) -> int:
    """The command's exit status: the one its process wrote as it ended. The server's report (`exitcode`) only
    where none was written (a signal ended it): a server that died meanwhile reports 255 for a command that
    ended normally (multiprocessing's popen_forkserver), which once failed a docs command that had printed all
    of its output."""
    try:
        with open(status_path) as status:
            return int(status.read())
    except (FileNotFoundError, ValueError):
        return exitcode


def _ended(pid: int, status_path: str, deadline: float) -> bool:
    """Whether the command has ended by `deadline`. The server reports a command's end, so when the server dies
    first its report (255) comes at once while the command may still run: then wait for the status the command
    writes as it ends, or for its process to be gone (a signal ended it: no status)."""
    while not os.path.exists(status_path) and _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _running(pid: int) -> bool:
    """pid is a live process (not a zombie: once the server is gone, init reaps the command)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def run_python(args: list[str], env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    """`python ARGS` (`-m MODULE ...` or `SCRIPT ...`): exit status, stdout and stderr; a run past `timeout`
    seconds is killed and raises subprocess.TimeoutExpired."""
    _start_server()
    command = ["python", *args]
    with tempfile.TemporaryDirectory(prefix="cli-") as tmp:
        out, err, status = (os.path.join(tmp, name) for name in ("stdout", "stderr", "status"))
        proc = _CONTEXT.Process(target=_child, args=(list(args), dict(env), str(cwd), out, err, status))
        _start(proc)
        deadline = time.monotonic() + timeout
        proc.join(timeout)
        if proc.is_alive() or not _ended(proc.pid, status, deadline):
            os.kill(proc.pid, 9) if proc.exitcode is not None else proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(command, timeout)
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(command, exit_status(status, proc.exitcode), o.read(), e.read())


def run_pretrain_cli(argv: list[str], env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
    """`python -m pretrain ARGV`."""
    return run_python(["-m", "pretrain", *argv], env, cwd, timeout)
