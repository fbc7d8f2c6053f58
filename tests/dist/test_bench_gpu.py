"""bench/bench_gpu.py --cpu-dry-run (what `make gpu-check` runs on a GPU, shrunk): every row runs, for the GPT and the
Llama shape, the throughput arithmetic is each model's FLOPs over the measured step time (Llama: grouped-query K/V and
the gated MLP's third matrix), and compiling a plain model changes no loss; the FP8 rows (`--fp8` on a GPU) run: the
Llama shape in precision.fp8 tensorwise and rowwise, and the Llama-3 8B rank slice probed in FP8; the FP8 ceiling
(bench/fp8_ceiling.py: the linears' GEMMs in bf16 and float8) is measured beside them."""
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = 'probe 100B precision.dtype="bf16" model.attention="auto" model.loss_chunk_tokens=1024 (dry run: fake, 2 layers, 1 step)'
FP8_PROBE = ('probe Llama-3 8B precision.fp8="tensorwise" model.attention="auto" model.loss_chunk_tokens=1024 '
             "(dry run: fake, 2 layers, 1 step)")


def model_flops(s: dict, vocab: int) -> float:
    """6 × tokens × matmul parameters + the attention scores (QKᵀ and AV over the whole s × s matrix, 3 × 4·s·h a token
    and layer), written out apart from model_shape/flops.py."""
    b, seq, L, h = s["micro"], s["seq"], s["layers"], s["hidden"]
    if s["kind"] == "llama":  # Q and O h × h, K and V h × (groups · head dim), gate, up and down h × ffn
        layer = 2 * h * h + 2 * h * (h // s["heads"] * s["query_groups"]) + 3 * h * s["ffn"]
    else:  # QKV 3h², O h², fc1 and fc2 4h² each
        layer = 12 * h * h
    return 6 * b * seq * (L * layer + h * vocab) + 12 * b * seq * L * seq * h


@pytest.mark.one_core  # one process for ~90 s: run in the side lane (tools/run_suite.py)
def test_bench_gpu_cpu_dry_run_rows():
    proc = subprocess.run([sys.executable, "-W", "ignore", "bench/bench_gpu.py", "--cpu-dry-run", "--steps", "1",
                           "--quick", "--json"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = {r["row"]: r for r in out["rows"]}
    zero3d = ["eager, stage 2", "compiled, stage 2", "compiled, stage 3"]
    assert list(rows) == [*(f"zero3d GPT ({z})" for z in zero3d), "plain PyTorch GPT, eager", "plain PyTorch GPT, compiled",
                          *(f"zero3d Llama ({z})" for z in zero3d), "zero3d Llama FP8 tensorwise (compiled, stage 2)",
                          "zero3d Llama FP8 rowwise (compiled, stage 2)", "plain PyTorch Llama, eager",
                          "plain PyTorch Llama, compiled", PROBE, FP8_PROBE]
    # each training row went to stderr as it was measured: what tools/gpu_check.py keeps of a table a time budget stops
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    measured = gpu_check.measured_rows(proc.stderr.encode())  # a timeout leaves the captured stderr as bytes
    assert sorted(measured, key=lambda r: r["row"]) == sorted(out["rows"][:12], key=lambda r: r["row"])
    # the compiled plain model (the ratios' baseline), then the eager one, first of each shape: a cut table has them
    assert [r["row"] for r in measured[:2]] == ["plain PyTorch GPT, compiled", "plain PyTorch GPT, eager"]
    assert [r["row"] for r in measured[5:7]] == ["plain PyTorch Llama, compiled", "plain PyTorch Llama, eager"]
    kept = gpu_check.BenchCut(measured[:5], "bench/bench_gpu.py").text
    assert "after 5 row(s)" in kept and all(f"| {r['row']} | {r['tokens_per_s']:.0f} |" in kept for r in measured[:5])
    zero3d_eager = next(r for r in measured[:5] if r["row"] == "zero3d GPT (eager, stage 2)")
    ratio = zero3d_eager["tokens_per_s"] / measured[0]["tokens_per_s"]
    assert f"| zero3d GPT (eager, stage 2) | {zero3d_eager['tokens_per_s']:.0f} | {ratio:.3f} |" in kept
    v = 512  # both dry shapes' vocabulary: already a multiple of 128, so megatron pads nothing
    # the hand formula itself: 2 layers × 64 hidden, GPT-2's 72·B·s·L·h²·(1 + s/6h) + 6·B·s·h·V, and the Llama shape's
    # gated MLP (3 × 64 × 160) and its K, V of 2 heads × 16 wide (beside 4 query heads)
    assert math.isclose(model_flops(out["shapes"]["gpt"], v),
                        72 * 2 * 32 * 2 * 64 * 64 * (1 + 32 / (6 * 64)) + 6 * 2 * 32 * 64 * v, rel_tol=1e-12)
    assert model_flops(out["shapes"]["llama"], v) == (6 * 64 * (2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 160) + 64 * v)
                                                      + 12 * 64 * 2 * 32 * 64)
    for name in list(rows)[:12]:
        r, kind = rows[name], ("llama" if "Llama" in name else "gpt")
        s = out["shapes"][kind]
        assert r["shape"] == kind, name
        assert math.isclose(r["tokens_per_s"], s["micro"] * s["seq"] / r["step_s"], rel_tol=1e-9), name
        assert math.isclose(r["tflops"] * r["step_s"] * 1e12, model_flops(s, v), rel_tol=1e-9), name
        assert r["mfu"] is None and r["peak_bytes"] is None  # CPU: no peak to divide by, no CUDA allocator
        assert 0 < r["loss"] < 2 * math.log(v), name  # trained from about ln(vocab), not diverged
    # the same weights, data and optimizer: compilation (and stage 3's gathers) must not change the math
    for model in ("GPT", "Llama"):
        assert math.isclose(rows[f"plain PyTorch {model}, compiled"]["loss"], rows[f"plain PyTorch {model}, eager"]["loss"],
                            rel_tol=1e-5), model
        for z in zero3d[1:]:
            assert math.isclose(rows[f"zero3d {model} ({z})"]["loss"], rows[f"zero3d {model} (eager, stage 2)"]["loss"],
                                rel_tol=1e-5), (model, z)
    for name in (PROBE, FP8_PROBE):
        assert rows[name]["rc"] == 0 and rows[name]["verdict"].startswith("verdict: FITS"), rows[name]
    # the FP8 ceiling beside the FP8 rows: the Llama shape's linear GEMMs timed in bf16 and float8, against the compiled
    # stage-2 bf16 row's step (bench/fp8_ceiling.py)
    baseline = rows["zero3d Llama (compiled, stage 2)"]["step_s"]
    ceilings = out["fp8_ceilings"]
    assert list(ceilings) == ["llama"] and [c["recipe"] for c in ceilings["llama"]] == ["tensorwise", "rowwise"]
    for c in ceilings["llama"]:
        assert c["bf16_step_s"] == baseline and c["linears_bf16_s"] > 0 and c["linears_fp8_s"] > 0
        assert math.isclose(c["ceiling"], baseline / (baseline - c["linears_bf16_s"] + c["linears_fp8_s"]), rel_tol=1e-12)
    # zero3d's rows carry the estimator's peak of their rank beside the measured one: what `python -m pretrain
    # --estimate` says of the row's config (its stage and compiled layers, one micro-batch a step), without the margin
    from pretrain.config import load_config
    from pretrain.memory_check import estimate_config
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench/bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for stage in (2, 3):
        s = out["shapes"]["gpt"]
        cfg = load_config(None, bench.model_overrides(s) + [
            f"train.micro_batch_size={s['micro']}", f"train.global_batch_size={s['micro']}", "precision.dtype=fp32",
            f"zero.stage={stage}", "model.compile=true"])
        memory = estimate_config(cfg, 1, 80 * 2**30)
        assert rows[f"zero3d GPT (compiled, stage {stage})"]["estimate_bytes"] == memory.total_bytes - memory.margin_bytes
    assert all(("estimate_bytes" in rows[name]) == name.startswith("zero3d") for name in list(rows)[:12])
    # the FP8 rows (--fp8 on a GPU; always in the dry run): the same weights and data as the zero3d row, float8 GEMMs
    for recipe in ("tensorwise", "rowwise"):
        fp8 = rows[f"zero3d Llama FP8 {recipe} (compiled, stage 2)"]["loss"]
        assert fp8 != rows["zero3d Llama (eager, stage 2)"]["loss"]
        assert math.isclose(fp8, rows["zero3d Llama (eager, stage 2)"]["loss"], rel_tol=0.02), recipe
