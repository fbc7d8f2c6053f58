"""The project's error types, the exit-code table (docs/exit-codes.md) and the one-line error format."""
import re

EXIT_OK = 0
EXIT_UNEXPECTED = 1  # a bug or an unforeseen failure: the traceback is shown
EXIT_CONFIG = 2  # a setting, or a combination of settings, is invalid
EXIT_INPUT = 3  # data, tokenizer, checkpoint files or the launch environment are unusable
EXIT_NUMERICAL = 4  # loss or gradient norm not finite for train.max_nonfinite_steps steps in a row
EXIT_PEER = 5  # a collective timed out, a peer rank vanished, or the watchdog saw no progress
EXIT_REQUEUE = 75  # EX_TEMPFAIL: stopped by a signal after a complete checkpoint; requeue to resume
EXIT_INTERRUPTED = 130  # 128 + SIGINT: interrupted before training started, or a second SIGINT: no new checkpoint


class ProjectError(Exception):
    """An error the entry point reports as one line, `error: <what> (<where>): <how to fix>`.

    `agreed` errors are raised identically on every rank (a setting, a file checked on rank 0 and
    shared): only rank 0 reports them. Others are local to the rank that raises them.
    """

    exit_code = EXIT_UNEXPECTED
    agreed = True
    default_fix = ""  # the line's fix when the message brings none

    def __init__(self, what: str, where: str = "", fix: str = "", agreed: "bool | None" = None):
        if not fix and "; " in what:  # "<what>; <how to fix>" in one message
            what, fix = what.split("; ", 1)
        self.what, self.where, self.fix = what, where, fix
        if agreed is not None:
            self.agreed = agreed
        super().__init__(what + (f"; {fix}" if fix else ""))

    def __reduce__(self):  # picklable with its parts (from_rank0 broadcasts errors)
        return type(self), (self.what, self.where, self.fix, self.agreed)

    def line(self) -> str:
        where = f" ({self.where})" if self.where else ""
        fix = self.fix or self.default_fix
        fix = f": {fix}" if fix else ""
        return f"error: {self.what}{where}{fix}"


class ConfigError(ProjectError, ValueError):
    """A config key or value is invalid; the message names the key, the value and what is valid."""

    exit_code = EXIT_CONFIG

    def __init__(self, what: str, where: str = "config", fix: str = "", agreed: "bool | None" = None):
        super().__init__(what, where, fix, agreed)


class InputError(ProjectError):
    """Data, tokenizer or checkpoint files, or the launch environment, cannot be used."""

    exit_code = EXIT_INPUT


class DataError(InputError, ValueError):
    """A corpus, token file or blend is unusable; the message names the file (and line) and what is wrong."""

    default_fix = "fix the file, or point data.corpus / data.blend at another"

    def __init__(self, what: str, where: str = "data", fix: str = "", agreed: "bool | None" = None):
        super().__init__(what, where, fix, agreed)


class TokenizerError(InputError, ValueError):
    """A tokenizer cannot be trained or loaded; the message names the file or the size at fault."""

    default_fix = "fix data.tokenizer_model or model.vocab_size"

    def __init__(self, what: str, where: str = "tokenizer", fix: str = "", agreed: "bool | None" = None):
        super().__init__(what, where, fix, agreed)


class CheckpointError(InputError):
    """A checkpoint that cannot be used, with the file and the reason (exit code 3, one line)."""

    def __init__(self, what: str, where: str = "checkpoint", fix: str = "", agreed: "bool | None" = None):
        super().__init__(what, where, fix, agreed)


class NumericalError(ProjectError):
    """The loss or the gradient norm stayed non-finite; the last good checkpoint is kept."""

    exit_code = EXIT_NUMERICAL


class RunInterrupted(ProjectError):
    """SIGINT before the loop took it as a stop request (start-up), or a second one: the run ends at once."""

    exit_code = EXIT_INTERRUPTED


class PeerTimeoutError(ProjectError):
    """A collective timed out or lost its peer, or the watchdog saw no progress on this rank."""

    exit_code = EXIT_PEER
    agreed = False


# What gloo / NCCL / the c10d store say when a peer does not answer, or is gone.
_PEER_TIMEOUT = re.compile(r"timed out|timeout|watchdog caught collective operation", re.I)
_PEER_LOST = re.compile(r"connection (closed|reset|refused)|broken pipe|recvValue failed|read error|"
                        r"socket (closed|error)|peer .* (closed|disconnect)", re.I)


PEER_LOST = "a peer rank exited or lost its connection during a collective"


def peer_error(err: BaseException, rank: int, timeout_s: float) -> "PeerTimeoutError | None":
    """The torch.distributed failure `err` as a PeerTimeoutError naming this rank, or None if it is not one."""
    if isinstance(err, PeerTimeoutError):
        return err
    if not isinstance(err, RuntimeError):  # torch.distributed raises RuntimeError (DistBackendError, gloo)
        return None
    text = (str(err).strip().splitlines() or [""])[0]
    if _PEER_TIMEOUT.search(text):
        return PeerTimeoutError(f"a collective waited longer than train.timeout_minutes ({timeout_s:g} s) "
                                "for a peer rank", f"rank {rank}",
                                "a peer is stuck or overloaded; see the other ranks' logs, or raise "
                                "train.timeout_minutes if steps are legitimately slower")
    if _PEER_LOST.search(text):
        return PeerTimeoutError(PEER_LOST, f"rank {rank}", "see the failing peer's own error line or its exit status")
    return None

