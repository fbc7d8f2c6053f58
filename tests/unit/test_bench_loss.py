"""bench/bench_loss.py (part 3 of `tools/gpu_check.py --parity`) runs and its `dW err` column is each path's weight
gradient against the fp32 one: in fp32 every path is that gradient to float rounding, so a bench that compared the
wrong tensors, or a loss path whose weight gradient went wrong, shows there before a GPU's time is spent on it."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_loss_bench_prints_each_paths_weight_gradient_error_against_fp32():
    proc = subprocess.run([sys.executable, "-W", "ignore", "bench/bench_loss.py", "--vocab", "300", "--tokens", "48",
                           "--hidden", "16", "--chunk", "16", "--steps", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["vocab", "path"])
    assert lines[header].split()[-2:] == ["dW", "err"]
    rows = {line.split()[1]: float(line.split()[-1]) for line in lines[header + 1:] if line.strip()}
    assert set(rows) == {"megatron", "recomputed", "fused"}  # fp32: no compiled softmax path
    assert rows["megatron"] == 0.0  # the reference itself, in fp32
    assert all(0.0 < error < 1e-5 for path, error in rows.items() if path != "megatron"), rows
