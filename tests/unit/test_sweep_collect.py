"""slurm/sweep.py --include-oom lets the paper's OOM jobs run out of memory; collect.py reads any run directory."""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from slurm import collect, sweep  # noqa: E402

OOM_JOBS = {"fig5_100B_zero_c1", "fig5_100B_zero_c2", "fig5_100B_zero_c3"}  # [paper] expected = "oom"


def test_include_oom_turns_the_memory_guard_off_for_those_jobs_only(monkeypatch, capsys, gpt2_overrides):
    monkeypatch.setattr(sweep, "launch_preview", lambda job: "")
    assert sweep.main(["--figure", "5", "--include-oom", "--dry-run", *gpt2_overrides]) == 0
    lines = {ln.split(":")[0]: ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("fig5_")}
    assert OOM_JOBS < set(lines)
    for name, line in lines.items():
        assert ("train.ignore_memory_estimate=true" in line) == (name in OOM_JOBS), line


def test_an_out_of_memory_run_is_collected_as_oom(tmp_path):
    """A torchrun run (no Slurm log): the OOM is in status.json's reason."""
    reason = "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB (GPU 3; 31.75 GiB total capacity)"
    (tmp_path / "status.json").write_text(json.dumps({"status": "failed", "reason": reason, "world_size": 400,
                                                      "steps": 0, "exit_code": 1, "error": ""}))
    assert collect.run_status(tmp_path, [], 10) == ("oom", reason)


def test_missing_run_dir_is_named_in_one_line(tmp_path, capsys):
    assert collect.main([str(tmp_path / "nope"), "--out", str(tmp_path / "out"), "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: run directory '{tmp_path / 'nope'}' does not exist\n"


def test_run_dir_without_config_json_asks_for_config(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    assert collect.main([str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--no-plot"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no config.json" in err and "--config FILE.toml" in err


def test_a_figure_job_that_never_ran_is_a_missing_row(tmp_path):
    """--figure N names runs/<name> of every config: one not run yet is a row, not an error."""
    row = collect.collect_run(tmp_path / "never", REPO / "configs/paper/fig2_100B_zero.toml")
    h, padded = 8192, 51200  # 50257 padded to a multiple of 128 × TP 16
    assert (row["status"], row["params"]) == ("missing", 125 * (12 * h * h + 13 * h) + 2 * h + 2 * padded * h + 1024 * h)


def test_a_refused_start_is_collected_with_the_ranks_own_line(tmp_path):
    """No status.json (a refused start writes nothing): the reason is zero3d's one-line error from the Slurm
    log, not srun's line about the exit code that follows it."""
    line = "error: data.corpus = '/x.jsonl' does not exist (data): point data.corpus at JSONL files"
    (tmp_path / "slurm-7.out").write_text(f"zero3d job 7: 1 node(s)\n{line}\nsrun: error: z3node1: tasks 0-3: "
                                          "Exited with exit code 3\ntraining step exited with status 3; run status: none\n")
    assert collect.run_status(tmp_path, [], 4) == ("failed", f"no status.json; 0/4 steps logged; {line}")
