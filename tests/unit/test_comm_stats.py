"""Communication accounting: calls per collective beside the volume, and the hidden-time fraction."""
from fractions import Fraction

from zero3d.comm.core import CommStats, PendingCollective


class FakeWork:
    """A torch work handle stand-in whose completion the test decides."""

    def __init__(self):
        self.done, self.waited = False, 0

    def is_completed(self):
        return self.done

    def wait(self):
        self.waited += 1
        self.done = True
        return True


def test_calls_are_reported_beside_elements():
    stats = CommStats()
    for _ in range(3):
        stats.add("reduce_scatter", "grads", Fraction(10), 2)
    stats.add("all_gather", "params", Fraction(30), 2)
    report = stats.report()
    assert report["comm/reduce_scatter/grads/calls"] == 3
    assert report["comm/reduce_scatter/grads/elements"] == 30.0
    assert report["comm/all_gather/params/calls"] == 1
    assert report["comm/total/calls"] == 4
    assert "comm/time/hidden_fraction" not in report  # nothing timed yet
    stats.reset()
    assert stats.report()["comm/total/calls"] == 0


def test_collectives_seen_complete_by_poll_are_hidden():
    stats = CommStats()
    work = FakeWork()
    pending = PendingCollective(work, stats)
    work.done = True
    stats.poll()  # a hook on the compute timeline sees it finished
    assert stats.in_flight == [] and stats.seconds > 0
    pending.wait()  # no blocking: nothing exposed
    assert work.waited == 1 and stats.exposed_seconds == 0
    assert stats.report()["comm/time/hidden_fraction"] == 1.0


def test_a_wait_on_an_unfinished_collective_is_exposed():
    stats = CommStats()
    work = FakeWork()
    PendingCollective(work, stats).wait()
    assert stats.in_flight == []
    assert 0 < stats.exposed_seconds <= stats.seconds
    assert 0.0 <= stats.hidden_fraction() < 1.0
