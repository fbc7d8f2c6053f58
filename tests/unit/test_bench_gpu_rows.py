"""bench/bench_gpu.py: a row that fails (the H200's Triton could not build an inductor kernel of an FP8 row) is one
line of the table, and the other rows are still measured and printed; the exit code says a row failed. --profile-row
chooses the rows --profile measures."""
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LLAMA_ROWS = ["plain PyTorch Llama, compiled", "plain PyTorch Llama, eager", "zero3d Llama (eager, stage 2)",
              "zero3d Llama (compiled, stage 2)", "zero3d Llama (compiled, stage 3)",
              "zero3d Llama FP8 tensorwise (compiled, stage 2)", "zero3d Llama FP8 rowwise (compiled, stage 2)"]


def load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stub_rows(monkeypatch, bench, on_row):
    """bench's two row functions replaced by ones that measure nothing: each calls `on_row(label, fp8, profile)`
    (which may raise, as a failing row does) and returns a row of 0.5 s a step (zero3d) or 0.25 s (plain)."""
    def zero3d_row(shape, device, steps, fp8="none", stage=2, compiled=False, dry=False, profile=None):
        label = bench.zero3d_label(shape, fp8, stage, compiled)
        on_row(label, fp8, profile)
        return bench.row(label, 0.5, shape, device, 9.0)

    def plain_row(shape, device, compiled, dry, steps, profile=None):
        label = bench.plain_label(shape, compiled)
        on_row(label, "none", profile)
        return bench.row(label, 0.25, shape, device, 9.0)

    monkeypatch.setattr(bench, "zero3d_row", zero3d_row)
    monkeypatch.setattr(bench, "plain_row", plain_row)


def test_a_failing_row_is_one_line_and_the_table_goes_on(monkeypatch, capsys):
    bench = load("bench/bench_gpu.py", "bench_gpu_rows")
    made = []

    def on_row(label, fp8, profile):
        made.append(label)
        if fp8 == "rowwise":
            raise AttributeError("'triton.compiler.ir.builder' object has no attribute 'get_fp8e5'\nmore lines")

    stub_rows(monkeypatch, bench, on_row)
    assert bench.main(["--cpu-dry-run", "--shapes", "llama", "--no-probes", "--steps", "1"]) == 1
    out = capsys.readouterr().out
    # measured the compiled plain model (the ratios' baseline) first; the table keeps its order
    assert made == LLAMA_ROWS
    assert [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| ") and "Llama" in line] == [
        "| zero3d Llama (eager, stage 2)", "| zero3d Llama (compiled, stage 2)", "| zero3d Llama (compiled, stage 3)",
        "| zero3d Llama FP8 tensorwise (compiled, stage 2)",
        "| zero3d Llama FP8 rowwise (compiled, stage 2) (rc 2, error: AttributeError: 'triton.compiler.ir.builder' "
        "object has no attribute 'get_fp8e5')", "| plain PyTorch Llama, eager", "| plain PyTorch Llama, compiled"]
    failed = [line for line in out.splitlines() if "FP8 rowwise" in line]
    assert failed == ["| zero3d Llama FP8 rowwise (compiled, stage 2) (rc 2, error: AttributeError: "
                      "'triton.compiler.ir.builder' object has no attribute 'get_fp8e5') | — | — | — | — | — | — | — "
                      "| — |"]
    measured = [line for line in out.splitlines() if line.startswith("| zero3d Llama (eager, stage 2) |")]
    assert measured and measured[0].split(" | ")[2] == "0.500"  # half the compiled plain row's tokens/s


def test_profile_rows_choose_which_rows_run_under_the_profiler(monkeypatch, tmp_path, capsys):
    """--profile-row TEXT (gpu_check --parity's: the compiled stage-2 rows, FP8 among them, and the compiled plain model)
    profiles only the rows whose label holds one of the texts; without it every row; without --profile it is refused
    in one line."""
    bench = load("bench/bench_gpu.py", "bench_gpu_profiled")
    profiled = []
    stub_rows(monkeypatch, bench, lambda label, fp8, profile: profile is not None and profiled.append(label))
    chosen = [arg for text in load("tools/gpu_check.py", "gpu_check_rows").PROFILED_ROWS
              for arg in ("--profile-row", text)]
    args = ["--cpu-dry-run", "--shapes", "llama", "--no-probes", "--steps", "1", "--profile", str(tmp_path)]
    assert bench.main(args + chosen) == 0
    assert sorted(profiled) == sorted(["plain PyTorch Llama, compiled", "zero3d Llama (compiled, stage 2)",
                                       "zero3d Llama FP8 tensorwise (compiled, stage 2)",
                                       "zero3d Llama FP8 rowwise (compiled, stage 2)"])
    profiled.clear()
    assert bench.main(args) == 0
    assert sorted(profiled) == sorted(LLAMA_ROWS)
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        bench.main(["--cpu-dry-run", "--profile-row", "FP8"])
    assert refused.value.code == 2
    assert "--profile-row 'FP8' chooses rows to profile: give --profile DIR too" in capsys.readouterr().err


def test_the_parity_command_profiles_the_llama_benchs_chosen_rows(monkeypatch, tmp_path):
    """tools/gpu_check.py --parity hands bench_gpu's Llama part --profile (a folder beside the report) and one
    --profile-row per PROFILED_ROWS text; its GPT part profiles nothing. Every subprocess stood in for."""
    import argparse
    import subprocess
    tool = load("tools/gpu_check.py", "gpu_check_parity")
    parts = []
    monkeypatch.setattr(tool, "ensure_megatron", lambda: {})
    monkeypatch.setattr(tool, "versions", lambda env: {"gpus": 0})
    monkeypatch.setattr(tool, "bench_table", lambda env, dry, quick, timeout, extra=(): parts.append(extra) or "")
    monkeypatch.setattr(tool, "probe_row", lambda name, *args, **kwargs: {"row": f"probe {name}", "rc": 0})
    monkeypatch.setattr(tool, "write_report", lambda *args: None)
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: subprocess.CompletedProcess(args, 0, "", ""))
    out = tmp_path / "gpu-check" / "report.md"
    args = argparse.Namespace(cpu_dry_run=True, budget_s=3600.0, out=str(out))
    assert tool.parity(args, started=tool.time.perf_counter()) == 0
    llama, gpt = parts
    assert llama[:llama.index("--profile")] == ("--shapes", "llama", "--fp8", "--no-probes", "--steps", "1")
    assert llama[llama.index("--profile"):] == ("--profile", str(tmp_path / "gpu-check" / "profiles"),
                                                "--profile-row", "(compiled, stage 2)",
                                                "--profile-row", "PyTorch Llama, compiled")
    assert "--profile" not in gpt
