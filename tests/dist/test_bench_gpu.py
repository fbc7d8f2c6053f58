"""bench/bench_gpu.py --cpu-dry-run (what `make gpu-check` runs on a GPU, shrunk): every row runs, the throughput
arithmetic is Megatron's FLOPs formula over the measured step time, and compiling the plain GPT changes no loss."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.one_core  # one process for ~40 s: run in the side lane (tools/run_suite.py)
def test_bench_gpu_cpu_dry_run_rows():
    proc = subprocess.run([sys.executable, "-W", "ignore", "bench/bench_gpu.py", "--cpu-dry-run", "--steps", "1",
                           "--quick", "--json"], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {r["row"]: r for r in out["rows"]}
    assert list(rows) == ["zero3d (attention auto, stage 2)", "plain PyTorch GPT, eager", "plain PyTorch GPT, compiled",
                          'probe 100B precision.dtype="bf16" model.attention="auto" model.loss_chunk_tokens=1024 (dry run: fake, 2 layers)']
    s = out["shape"]
    b, seq, L, h, v = s["micro"], s["seq"], s["layers"], s["hidden"], 512  # vocab 512: already a multiple of 128
    flops = 72 * b * seq * L * h * h * (1 + seq / (6 * h)) + 6 * b * seq * h * v
    for name in list(rows)[:3]:
        r = rows[name]
        assert math.isclose(r["tokens_per_s"], b * seq / r["step_s"], rel_tol=1e-9), name
        assert math.isclose(r["tflops"], flops / r["step_s"] / 1e12, rel_tol=1e-9), name
        assert r["mfu"] is None and r["peak_bytes"] is None  # CPU: no peak to divide by, no CUDA allocator
        assert 0 < r["loss"] < 2 * math.log(v), name  # trained from about ln(vocab), not diverged
    # the same weights, data and optimizer: compilation must not change the math
    assert math.isclose(rows["plain PyTorch GPT, compiled"]["loss"], rows["plain PyTorch GPT, eager"]["loss"],
                        rel_tol=1e-5)
    probe = rows['probe 100B precision.dtype="bf16" model.attention="auto" model.loss_chunk_tokens=1024 (dry run: fake, 2 layers)']
    assert probe["rc"] == 0 and probe["verdict"].startswith("verdict: FITS"), probe
