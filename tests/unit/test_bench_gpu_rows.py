"""bench/bench_gpu.py: a row that fails (the H200's Triton could not build an inductor kernel of an FP8 row) is one
line of the table, and the other rows are still measured and printed; the exit code says a row failed. --profile-row
chooses the rows --profile measures."""
import importlib.util
import json
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
                      "| — | — |"]
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


def test_the_parity_command_profiles_the_8b_slices_selective_probes_on_a_gpu(monkeypatch, tmp_path):
    """On a GPU (not the dry run, whose probes run fake tensors), --parity hands the two selective 8B probes (bf16 and
    FP8: the pair #58 compares) a --profile folder each beside the report, the recipe's probe none; probe_row puts
    --profile on the probe's command line, the probe's kernels in the row, and the report carries their table."""
    import argparse
    import subprocess
    tool = load("tools/gpu_check.py", "gpu_check_probe_profiles")
    calls, reports = {}, []
    monkeypatch.setattr(tool, "ensure_megatron", lambda: {})
    monkeypatch.setattr(tool, "versions", lambda env: {"gpus": 1})
    monkeypatch.setattr(tool, "bench_table", lambda *args, **kwargs: "")

    def probe_row(name, *args, **kwargs):
        calls[name] = kwargs
        return {"row": f"probe {name}", "rc": 0}
    monkeypatch.setattr(tool, "probe_row", probe_row)
    monkeypatch.setattr(tool, "write_report", lambda *args: reports.append(args))
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: subprocess.CompletedProcess(args, 0, "", ""))
    out = tmp_path / "gpu-check" / "report.md"
    assert tool.parity(argparse.Namespace(cpu_dry_run=False, budget_s=3600.0, out=str(out)),
                       started=tool.time.perf_counter()) == 0
    profiles = tmp_path / "gpu-check" / "profiles"
    assert {name: kwargs["profile"] for name, kwargs in calls.items()} == {
        "Llama-3 8B recipe": "",
        "Llama-3 8B selective compiled": str(profiles / "Llama_3_8B_selective_compiled"),
        "Llama-3 8B selective compiled FP8": str(profiles / "Llama_3_8B_selective_compiled_FP8")}

    tool = load("tools/gpu_check.py", "gpu_check_probe_row")
    kernels = {"step_s": 9.5, "device_busy_s": 9.0, "device_idle": 0.05, "kernels_per_step": 1234,
               "kinds_s": {"gemm": 5.0, "compiled (triton)": 3.0}, "top": [("sm90_xmma_gemm_e4m3", 4.0, 64)],
               "by_op": [("aten::copy_", 0.5, 32)]}
    printed = {"verdict": {"text": "verdict: FITS"}, "run": {"cuda_max_allocated": 5e10, "peak_phase": "backward",
                                                            "profile": kernels, "step_seconds": [21.5, 9.25]},
               "timing": {"compute_s_per_step": 9.0}}
    commands = []
    monkeypatch.setattr(tool.subprocess, "run", lambda cmd, **kwargs: commands.append(cmd) or
                        subprocess.CompletedProcess(cmd, 0, json.dumps(printed), ""))
    row = tool.probe_row("slice", "configs/llama3_8b.toml", {}, False, 60, overrides=["model.compile=true"],
                         memory_gb=80, profile="/tmp/p")
    assert commands[0][commands[0].index("--real"):] == ["--real", "--profile", "/tmp/p"]
    assert row["profile"] == json.loads(json.dumps(kernels))  # as the probe printed it: JSON lists
    tool.write_report(out, {"gpu": "H200", "gpus": 1, "torch": "t", "cuda": "c", "nccl": "n", "megatron_core": "m",
                            "transformer_engine": False}, [row], [], tool.time.perf_counter())
    report = out.read_text()
    assert "| probe slice model.compile=true --real, 80 GB cap | 9.5000 | 9.0000 | 5.0% | 1234 |" in report
    assert "    4.0000     64  sm90_xmma_gemm_e4m3" in report and "    0.5000     32  aten::copy_" in report
    assert "| — | 21.50, 9.25 |" in report  # every step's wall: the warm-up's beside the timed one's


def test_the_parity_command_measures_the_8b_slices_fp8_ceiling_after_its_probes(monkeypatch, tmp_path):
    """On a GPU, after the FP8 8B probe, --parity runs bench/fp8_ceiling.py on the slice's config against the bf16
    selective probe's step, the FP8 probe's beside it, and its table goes in the report; without the bf16 step time,
    one line says so and nothing runs."""
    import argparse
    import subprocess
    tool = load("tools/gpu_check.py", "gpu_check_ceiling")
    steps = {"Llama-3 8B selective compiled": 8.25, "Llama-3 8B selective compiled FP8": 7.5}
    commands, reports = [], []
    monkeypatch.setattr(tool, "ensure_megatron", lambda: {})
    monkeypatch.setattr(tool, "versions", lambda env: {"gpus": 1})
    monkeypatch.setattr(tool, "bench_table", lambda *args, **kwargs: "")
    monkeypatch.setattr(tool, "probe_row", lambda name, *args, **kwargs: {"row": f"probe {name} --real", "rc": 0,
                                                                          "step_s": steps.get(name)})
    monkeypatch.setattr(tool, "write_report", lambda *args: reports.append(args))

    def run(cmd, **kwargs):
        commands.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "FP8 ceiling table\n" if "bench/fp8_ceiling.py" in cmd else "", "")
    monkeypatch.setattr(subprocess, "run", run)
    args = argparse.Namespace(cpu_dry_run=False, budget_s=3600.0, out=str(tmp_path / "report.md"))
    assert tool.parity(args, started=tool.time.perf_counter()) == 0
    ceiling = [cmd for cmd in commands if "bench/fp8_ceiling.py" in cmd]
    assert len(ceiling) == 1 and ceiling[0][ceiling[0].index("bench/fp8_ceiling.py") + 1:] == [
        "--config", "configs/llama3_8b.toml", "--bf16-step-s", "8.25", "--recipe", "tensorwise",
        "--fp8-step-s", "tensorwise=7.5"]
    assert "FP8 ceiling table" in reports[0][-1]
    assert tool.fp8_ceiling_part({}, {"row": "bf16"}, {"step_s": 7.5}, timeout=60) == (
        "FP8 ceiling of the 8B slice not measured: the probe 'Llama-3 8B selective compiled' has no step time\n")
