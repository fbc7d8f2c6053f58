"""Where a training step's time goes: data, forward, backward (or, pipelined, megatron's interleaved
forward_backward), the optimizer step, and the communication the training thread was blocked on."""
import time
from typing import Callable, Optional

import torch

PHASES = ("data", "forward", "backward", "forward_backward", "optimizer")


class PhaseClock:
    """Tiles one step into consecutive phases: `start` opens the step, `enter(phase)` closes the open phase and
    opens the next (a phase entered again adds up: each micro-batch's forward and backward), `stop` closes the last.
    Each phase's time is its span less the exposed communication inside it (`exposed()`: zero3d's CommStats'
    seconds the training thread spent blocked in waits and synchronous collectives, cumulative over the step), so
    the phases plus `comm_exposed` add up to the clock's whole span, the step time.

    On CPU the spans are the host's clock. On CUDA they are the current stream's: an event recorded at each
    boundary, read once `stop` follows the step's synchronize, so a phase is the GPU time between its boundaries
    (the host's data loading included where the stream was idle for it); CommStats counts host-side blocking only
    there (a wait orders streams), so communication the stream waited on stays inside its phase."""

    def __init__(self, exposed: Callable[[], float], cuda: bool = False):
        self.exposed, self.cuda = exposed, cuda
        self.times: dict[str, float] = {}
        self.comm = 0.0
        self._marks: list[tuple[Optional[str], float, float, object]] = []  # (phase opened, time, exposed, event)

    def _mark(self, phase: Optional[str]) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._marks.append((phase, time.perf_counter(), self.exposed(), event))

    def start(self) -> None:
        self.times, self.comm, self._marks = {}, 0.0, []
        self._mark(None)

    def enter(self, phase: str) -> None:
        if self._marks:
            self._mark(phase)

    def stop(self) -> None:
        """Close the step (after its synchronize on CUDA): the phase times and the exposed communication."""
        if not self._marks:
            return
        self._mark(None)
        for (phase, t0, e0, ev0), (_, t1, e1, ev1) in zip(self._marks, self._marks[1:]):
            span = ev0.elapsed_time(ev1) / 1e3 if self.cuda else t1 - t0
            if phase is None:  # between start and the first phase: the loop's own bookkeeping, counted as data
                phase = "data"
            self.times[phase] = self.times.get(phase, 0.0) + span - (e1 - e0)
            self.comm += e1 - e0
        self._marks = []

    def report(self) -> dict:
        """perf/phase/<phase>_s for each phase the step went through, and perf/phase/comm_exposed_s."""
        if not self.times:
            return {}
        return {**{f"perf/phase/{p}_s": self.times[p] for p in PHASES if p in self.times},
                "perf/phase/comm_exposed_s": self.comm}


class NoClock:
    """A step timed by nobody (the probe's, evaluation's): every call does nothing."""

    def enter(self, phase: str) -> None:
        pass


NO_CLOCK = NoClock()
