"""When the training loop stops early: a stop signal on any rank, or a streak of non-finite steps."""
import math
import os
import signal
import sys
from typing import Callable

from pretrain.config import Config
from pretrain.errors import EXIT_INTERRUPTED, NumericalError


class StopRequest:
    """SIGUSR1 (Slurm's warning before the time limit or preemption), SIGTERM or SIGINT (Ctrl-C) asks for a
    stop: after this step, with a checkpoint.

    A signal may reach some ranks only, or reach them at different steps; `pretrain.step.finish_step` sums the flag
    over every rank in the step's one all-reduce, so all ranks save the same checkpoint and leave together.
    A second SIGINT calls `abort` (one line, status.json) and ends the process at once, exit 130: the
    checkpoint being written, if any, is left as an incomplete .tmp that the next start removes.
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

    def __init__(self, abort: Callable[[], None] = lambda: None):
        self.requested, self.interrupts, self._abort = False, 0, abort
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self.SIGNALS}
        # `python -m pretrain` blocks SIGUSR1 until now: one that came early is delivered here.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)

    def _on_signal(self, signum, frame):
        self.requested = True
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts >= 2:
                try:
                    self._abort()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(EXIT_INTERRUPTED)

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class NonfiniteGuard:
    """Stops the run after `limit` consecutive steps whose loss or gradient norm is not finite.

    An fp16 step skipped for overflow is the loss scaler's business and does not count, unless the
    scale is already at precision.min_loss_scale and can back off no further.
    """

    def __init__(self, cfg: Config):
        self.limit, self.fp16 = cfg.train.max_nonfinite_steps, cfg.precision.dtype == "fp16"
        self.min_scale = cfg.precision.min_loss_scale
        self.streak = 0

    def is_nonfinite(self, loss: float, grad_norm: float, loss_scale: float) -> bool:
        """The verdict on one step: the same on every rank, which all hold the same loss, norm and scale
        (pretrain.step.finish_step reads them from one all-reduce)."""
        if not math.isfinite(loss):
            return True
        if math.isfinite(grad_norm):
            return False
        return not (self.fp16 and loss_scale > self.min_scale)

    def update(self, nonfinite: bool, step: int, loss: float, grad_norm: float, last_good: str) -> None:
        """Count an agreed verdict; raises NumericalError when the streak reaches the limit."""
        self.streak = self.streak + 1 if nonfinite else 0
        if self.streak >= self.limit:
            raise NumericalError(
                f"loss or gradient norm not finite for {self.streak} consecutive steps "
                f"(steps {step - self.streak + 1}-{step}: loss {loss}, grad norm {grad_norm})", f"step {step}",
                f"no checkpoint was saved over the last good one ({last_good}); lower optimizer.lr, "
                "check the data, or raise train.max_nonfinite_steps to tolerate more")
