"""bench/bench_zero.py's collective counter (a shim around torch.distributed, the same for every system) sees every
element zero3d moves: stages 0-3 in the paper's ratios 1 : 1 : 1 : 1.5 (issue #35: it saw half, then a third, while
zero3d's all-gathers went through a function bound at import)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STAGES = ["zero3d-0", "zero3d-1", "zero3d-2", "zero3d-3"]


def test_the_shim_counts_what_zero3d_counts_at_every_stage(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, "-W", "ignore", "bench/bench_zero.py", "--ranks", "2", "--layers", "1",
                           "--hidden", "64", "--heads", "2", "--seq", "32", "--vocab", "128", "--micro", "2",
                           "--steps", "3", "--systems", *STAGES, "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert all("error" not in rows[s] for s in STAGES), rows
    for system in STAGES:  # every element of zero3d's own count passes through torch.distributed's Python API
        assert rows[system]["comm_elements"] == pytest.approx(rows[system]["zero3d_elements"], rel=1e-12), system
    base = rows["zero3d-0"]["comm_elements"]
    # stages 1 and 2: reduce-scatter + all-gather = the all-reduce's 2Ψ(N−1)/N; stage 3: one more all-gather.
    # Up to padding: each bucket of the sharded stages is padded to a multiple of N = 2 (+1 element at most).
    for system, ratio in zip(STAGES, (1, 1, 1, 1.5)):
        assert rows[system]["comm_elements"] == pytest.approx(ratio * base, rel=1e-3), (system, rows[system])
