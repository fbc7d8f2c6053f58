"""pretrain/probe/kernels.py on a synthetic chrome trace: the device's busy time is the union of its kernels' intervals
(overlaps counted once), kernels sum by kind per step, and a kernel outside the model's GEMMs / attention / compiled
code is charged to the CPU op that launched it, with the innermost enclosing non-aten frame."""
import pytest

import pretrain.probe.kernels as kp


def test_busy_time_counts_overlaps_once():
    assert kp.busy_seconds([(0, 10), (5, 15), (20, 30), (21, 22)]) == pytest.approx(25e-6)
    assert kp.busy_seconds([]) == 0


def test_kernels_by_kind_and_by_launching_op():
    cpu = lambda name, ts, dur, ext=None: {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": 1,
                                           "args": {} if ext is None else {"External id": ext}}
    events = [
        {"cat": "user_annotation", "name": "FusedLinearCrossEntropy", "ts": 0, "dur": 100, "tid": 1, "args": {}},
        cpu("aten::add_", 10, 5, ext=1), cpu("aten::mm", 20, 5, ext=2), cpu("aten::copy_", 200, 5, ext=3),
        {"cat": "kernel", "name": "void elementwise_kernel<add>", "ts": 1000, "dur": 300, "args": {"External id": 1}},
        {"cat": "kernel", "name": "nvjet_sm90_tst_128x256", "ts": 1200, "dur": 600, "args": {"External id": 2}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 2000, "dur": 100, "args": {"External id": 3}},
    ]
    p = kp.summarize(events, steps=2, wall_s=0.004)
    assert p["step_s"] == 0.002 and p["kernels_per_step"] == 1.5
    assert p["device_busy_s"] == pytest.approx((800 + 100) / 1e6 / 2)  # 1000–1800 and 2000–2100 µs, over 2 steps
    assert p["kinds_s"] == pytest.approx({"gemm": 300e-6, "elementwise": 150e-6, "memory copy": 50e-6})
    assert [(op, n) for op, _, n in p["by_op"]] == [("FusedLinearCrossEntropy > aten::add_", 0),
                                                   ("aten::copy_", 0)]  # the GEMM is the model's: not listed
    assert p["by_op"][0][1] == pytest.approx(150e-6)
