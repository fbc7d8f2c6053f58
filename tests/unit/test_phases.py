"""pretrain/runtime/phases.py's arithmetic on a scripted clock: a step tiled into phases, each phase its span less the
exposed communication inside it, the communication apart, the whole equal to the step. (On real ranks, the phases
against the loop's own step time: tests/dist/test_train.py::test_metrics_file_has_every_field.)"""
from pretrain.runtime import phases


def test_each_phase_is_its_span_less_the_communication_it_waited_on(monkeypatch):
    # (time, exposed communication so far) at each boundary: start, data, forward, backward, forward, backward,
    # optimizer, stop — two micro-batches; 0.5 s waited on a gather in the 2nd forward, 1.0 s in the optimizer step
    marks = iter([(10.0, 0.0), (10.1, 0.0), (10.4, 0.0), (11.0, 0.0), (11.3, 0.0), (12.4, 0.5), (12.6, 0.5),
                  (14.0, 1.5)])
    exposed = {"now": 0.0}

    def perf_counter():
        t, exposed["now"] = next(marks)
        return t
    monkeypatch.setattr(phases.time, "perf_counter", perf_counter)
    clock = phases.PhaseClock(lambda: exposed["now"])
    clock.start()
    for name in ("data", "forward", "backward", "forward", "backward", "optimizer"):
        clock.enter(name)
    clock.stop()
    report = clock.report()
    # spans: start→data 0.1 (the loop's bookkeeping, counted as data), data 0.3, forward 0.6, backward 0.3,
    # forward 1.1 of which 0.5 waited, backward 0.2, optimizer 1.4 of which 1.0 waited
    expected = {"perf/phase/data_s": 0.1 + 0.3, "perf/phase/forward_s": 0.6 + (1.1 - 0.5),
                "perf/phase/backward_s": 0.3 + 0.2, "perf/phase/optimizer_s": 1.4 - 1.0,
                "perf/phase/comm_exposed_s": 0.5 + 1.0}
    assert report.keys() == expected.keys()
    for key, value in expected.items():
        assert abs(report[key] - value) < 1e-9, (key, report[key], value)
    assert abs(sum(report.values()) - (14.0 - 10.0)) < 1e-9  # the step, whole
    assert phases.PhaseClock(lambda: 0.0).report() == {}  # a step never timed reports nothing
