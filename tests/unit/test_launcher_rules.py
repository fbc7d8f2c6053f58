"""The launcher's verdict from its ranks' exit codes, and its flags, without starting a process."""
import os
import signal

import pytest

from pretrain import launcher
from pretrain.launcher import FORWARDED, parse_args, supervise


class Exited:
    """A rank that has already exited with `code` (negative: killed by that signal)."""

    def __init__(self, code: int):
        self.returncode = code
        self.killed = False

    def poll(self):
        return self.returncode

    def kill(self):
        self.killed = True


@pytest.mark.parametrize("codes,expected,line", [
    ([0, 0, 0], 0, None),
    ([75, 75, 0], 75, None),
    ([5, -9, 5], 137, "launcher: rank 1 was killed by SIGKILL; the other ranks were stopped"),
    ([5, 5, 3], 3, "launcher: rank 2 exited with code 3 (input error); the other ranks were stopped"),
    ([2, 2, 2], 2, "launcher: rank 0 exited with code 2 (config error); the other ranks were stopped"),
    ([5, 5, 0], 5, "launcher: rank 0 exited with code 5 (peer timeout); the other ranks were stopped"),
    ([0, 130, 130], 130, "launcher: rank 1 exited with code 130 (interrupted at once); the other ranks were stopped"),
], ids=["ok", "interrupted", "killed-before-peer-timeouts", "cause-before-peer-timeouts", "agreed-error", "only-timeouts",
        "second-sigint"])
def test_the_first_cause_decides_the_code_and_the_line(codes, expected, line, capsys):
    assert supervise([Exited(c) for c in codes], grace_s=0.0, first_rank=0) == expected
    err = capsys.readouterr().err
    assert (err.strip() or None) == (None if line is None else line + " (its own line above says why)")


def test_a_node_names_its_global_ranks(capsys):
    assert supervise([Exited(0), Exited(3)], grace_s=0.0, first_rank=4) == 3
    assert capsys.readouterr().err.startswith("launcher: rank 5 exited with code 3 (input error)")


@pytest.mark.parametrize("argv,message", [
    (["--nproc-per-node", "0"], "--nproc-per-node 0: must be >= 1"),
    (["--nnodes", "2", "--node-rank", "2", "--master-port", "29500"], "--node-rank 2: must be in 0..1"),
    (["--nnodes", "2"], "--nnodes > 1 needs --master-port (the same on every node)"),
])
def test_bad_flags_are_one_line_before_any_rank_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_every_other_argument_is_the_ranks():
    args, rest = parse_args(["--nproc-per-node", "4", "--config", "configs/tiny.toml", "zero.stage=3", "~data.corpus"])
    assert (args.nproc_per_node, rest) == (4, ["--config", "configs/tiny.toml", "zero.stage=3", "~data.corpus"])


def test_a_signal_after_the_ranks_exited_cannot_kill_the_launcher(monkeypatch, capsys):
    """Ctrl-C pressed again while the launcher exits: ignored (the ranks' 130 stands), not Python's default
    handling, which finalisation restores and which would end the launcher by SIGINT (status -2)."""
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: Exited(130))
    before = {sig: signal.getsignal(sig) for sig in FORWARDED}
    try:
        assert launcher.main(["--nproc-per-node", "2", "--config", "configs/tiny.toml"]) == 130
        assert {sig: signal.getsignal(sig) for sig in FORWARDED} == dict.fromkeys(FORWARDED, signal.SIG_IGN)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert "rank 0 exited with code 130" in capsys.readouterr().err


class StopsOnSignal:
    """A rank that runs until it is sent a signal, then exits 75 (a stop with a checkpoint), or after 40 looks (2 s
    of the launcher's polling) without one ends its run, 0; the first look at any rank sends `signal_to_send` to
    this process, the launcher, as a terminal, `docker stop` or Slurm would."""
    signal_to_send = None

    def __init__(self):
        self.received, self.returncode, self.looks = [], None, 0

    def poll(self):
        if StopsOnSignal.signal_to_send is not None:
            signum, StopsOnSignal.signal_to_send = StopsOnSignal.signal_to_send, None
            os.kill(os.getpid(), signum)
        self.looks += 1
        if self.returncode is None and (self.received or self.looks > 40):
            self.returncode = 75 if self.received else 0
        return self.returncode

    def send_signal(self, signum):
        self.received.append(signum)

    def kill(self):
        self.returncode = -9


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT], ids=lambda s: s.name)
def test_a_stop_signal_to_the_launcher_reaches_every_rank_once(monkeypatch, signum):
    """SIGTERM (a container's stop: the launcher is its first process), SIGUSR1 and SIGINT sent to the launcher are
    each passed to every rank once, and the ranks' 75 is its code. Until the launcher takes the signal, this test's
    own handler holds it (Python's default would end the test process)."""
    ranks = []
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: ranks.append(StopsOnSignal()) or ranks[-1])
    monkeypatch.setattr(StopsOnSignal, "signal_to_send", signum)
    before = {sig: signal.getsignal(sig) for sig in FORWARDED}
    unforwarded = []
    signal.signal(signum, lambda *a: unforwarded.append(signum))
    try:
        assert launcher.main(["--nproc-per-node", "2", "--config", "configs/tiny.toml"]) == 75
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    assert unforwarded == [] and [rank.received for rank in ranks] == [[signum], [signum]]
