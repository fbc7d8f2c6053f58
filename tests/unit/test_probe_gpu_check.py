"""tools/gpu_check.py's plan and report (the GPU rows themselves run only on a GPU machine)."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).resolve().parents[2] / "tools/gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

INFO = {"gpu": "NVIDIA H100 80GB HBM3", "gpus": 1, "torch": "2.11.0", "cuda": "13.0", "nccl": "2.28.9",
        "megatron_core": "0.16.1", "transformer_engine": False}


def test_one_gpu_plan_runs_every_stage_and_precision_and_says_what_it_skips():
    rows, skipped = gpu_check.plan_rows(INFO, quick=False, dry=False)
    labels = [label for label, _, _ in rows]
    assert labels == [label for label, _ in gpu_check.STAGE_ROWS] + [gpu_check.PA_CPU_ROW[0]]
    assert {ov[0] for _, ov, _ in rows} == {"zero.stage=0", "zero.stage=1", "zero.stage=2", "zero.stage=3"}
    assert skipped == ["world 2+: one GPU on this machine",
                       "Transformer Engine row: transformer_engine is not importable"]


def test_eight_gpus_add_nccl_world_8_rows_and_te_when_importable():
    rows, skipped = gpu_check.plan_rows(dict(INFO, gpus=8, transformer_engine=True), quick=True, dry=False)
    assert [world for _, _, world in rows].count(8) == 1 and rows[-1][0] == gpu_check.TE_ROW[0]
    assert skipped == []


def test_report_names_the_gpu_versions_rows_and_skips(tmp_path):
    rows = [{"row": "stage 0, bf16", "world": 1, "rc": 0, "loss": 6.3282, "loss_scale": 1.0, "step_s": 0.02,
             "tflops": 0.145, "mfu": 0.0001, "hfu": 0.0002, "max_allocated": 2**30, "wall_s": 30.0},
            {"row": "probe 100B --real, 32 GB cap", "rc": 1, "peak_bytes": None, "verdict": "verdict: does NOT fit",
             "wall_s": 50.0}]
    out = tmp_path / "report.md"
    gpu_check.write_report(out, INFO, rows, ["probe 60B: time budget"], started=0.0)
    text = out.read_text()
    assert "**NVIDIA H100 80GB HBM3** × 1; torch 2.11.0, CUDA 13.0, NCCL 2.28.9" in text
    assert "| stage 0, bf16 | 1 | 0 | 6.3282 | 1 | 0.0200 | 0.145 | 0.0% | 0.0% | 1.00 |" in text
    assert "verdict: does NOT fit" in text and "Skipped: probe 60B: time budget" in text


def test_a_failed_row_reports_the_error_line_not_torchruns_closing_banner():
    import subprocess
    stderr = ("[rank0]:   import zstandard\n[rank0]: ModuleNotFoundError: No module named 'zstandard'\n"
              "E1126 api.py:1002] failed (exitcode: 1)\n  time : 2026-11-26\n" + "=" * 60 + "\n")
    proc = subprocess.CompletedProcess([], 1, stdout="", stderr=stderr)
    assert gpu_check.error_line(proc) == ["[rank0]: ModuleNotFoundError: No module named 'zstandard'"]
    assert gpu_check.error_line(subprocess.CompletedProcess([], 1, stdout="", stderr="")) == ["(no output)"]


def test_a_gpu_probe_compares_model_states_and_the_peak_only():
    """On a GPU the probe has no per-category snapshot at the peak (CUDA's allocator counts bytes): its rows
    are the model states and the peak (the first --real run on an H100 failed with KeyError 'activations')."""
    from pretrain.probe.report import estimate_rows
    from analysis.estimate import MemoryBreakdown
    est = MemoryBreakdown(params_per_rank=1, param_bytes=1, grad_bytes=2, optimizer_bytes=3, checkpoint_bytes=4,
                          working_set_bytes=0, logits_bytes=0, buffer_bytes=5, margin_bytes=6, gpu_memory_bytes=100,
                          host_bytes=7)
    states = {"params": 10, "grads": 20, "optimizer": 30}
    assert [r[0] for r in estimate_rows(est, states, None, 99, 0)] == [
        "params", "grads", "optimizer (fp32 master + moments)", "peak (without margin)"]
    cpu = estimate_rows(est, states, {"activations": 40, "temporaries": 50}, 99, 70)
    assert [r[2] for r in cpu] == [10, 20, 30, 40, 50, 99, 70]
    assert [r[1] for r in cpu] == [1, 2, 3, 4, 5, est.total_bytes - 6, 7]
