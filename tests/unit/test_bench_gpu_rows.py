"""bench/bench_gpu.py: a row that fails (the H200's Triton could not build an inductor kernel of an FP8 row) is one
line of the table, and the other rows are still measured and printed; the exit code says a row failed."""
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_a_failing_row_is_one_line_and_the_table_goes_on(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_gpu_rows", REPO / "bench/bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    made = []

    def zero3d_row(shape, device, steps, fp8="none", stage=2, compiled=False, dry=False, profile=None):
        made.append(bench.zero3d_label(shape, fp8, stage, compiled))
        if fp8 == "rowwise":
            raise AttributeError("'triton.compiler.ir.builder' object has no attribute 'get_fp8e5'\nmore lines")
        return bench.row(made[-1], 0.5, shape, device, 9.0)

    def plain_row(shape, device, compiled, dry, steps, profile=None):
        made.append(bench.plain_label(shape, compiled))
        return bench.row(made[-1], 0.25, shape, device, 9.0)

    monkeypatch.setattr(bench, "zero3d_row", zero3d_row)
    monkeypatch.setattr(bench, "plain_row", plain_row)
    assert bench.main(["--cpu-dry-run", "--shapes", "llama", "--no-probes", "--steps", "1"]) == 1
    out = capsys.readouterr().out
    # measured the compiled plain model (the ratios' baseline) first; the table keeps its order
    assert made == ["plain PyTorch Llama, compiled", "plain PyTorch Llama, eager", "zero3d Llama (eager, stage 2)",
                    "zero3d Llama (compiled, stage 2)", "zero3d Llama (compiled, stage 3)",
                    "zero3d Llama FP8 tensorwise (compiled, stage 2)", "zero3d Llama FP8 rowwise (compiled, stage 2)"]
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
    profiles only the rows whose label holds one of the texts; without --profile it is refused in one line."""
    spec = importlib.util.spec_from_file_location("bench_gpu_profiled", REPO / "bench/bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    profiled = []

    def zero3d_row(shape, device, steps, fp8="none", stage=2, compiled=False, dry=False, profile=None):
        label = bench.zero3d_label(shape, fp8, stage, compiled)
        if profile is not None:
            profiled.append(label)
        return bench.row(label, 0.5, shape, device, 9.0)

    def plain_row(shape, device, compiled, dry, steps, profile=None):
        label = bench.plain_label(shape, compiled)
        if profile is not None:
            profiled.append(label)
        return bench.row(label, 0.25, shape, device, 9.0)

    monkeypatch.setattr(bench, "zero3d_row", zero3d_row)
    monkeypatch.setattr(bench, "plain_row", plain_row)
    gpu_check = importlib.util.spec_from_file_location("gpu_check_rows", REPO / "tools/gpu_check.py")
    tool = importlib.util.module_from_spec(gpu_check)
    gpu_check.loader.exec_module(tool)
    chosen = [arg for text in tool.PROFILED_ROWS for arg in ("--profile-row", text)]
    assert bench.main(["--cpu-dry-run", "--shapes", "llama", "--no-probes", "--steps", "1",
                       "--profile", str(tmp_path), *chosen]) == 0
    assert sorted(profiled) == sorted(["plain PyTorch Llama, compiled", "zero3d Llama (compiled, stage 2)",
                                       "zero3d Llama FP8 tensorwise (compiled, stage 2)",
                                       "zero3d Llama FP8 rowwise (compiled, stage 2)"])
    profiled.clear()
    assert bench.main(["--cpu-dry-run", "--shapes", "llama", "--no-probes", "--steps", "1", "--profile",
                       str(tmp_path)]) == 0
    assert len(profiled) == 7  # every row
    capsys.readouterr()
    with pytest.raises(SystemExit):
        bench.main(["--cpu-dry-run", "--profile-row", "FP8"])
    assert "--profile-row 'FP8' chooses rows to profile: give --profile DIR too" in capsys.readouterr().err
