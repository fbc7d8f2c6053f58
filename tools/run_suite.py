"""`make test`: the suite in two concurrent pytest lanes — tests that leave a core idle, and the rest.

Tests marked `waits` (the Slurm tier, the fail-fast timeouts: minutes of sleeping on schedulers, heartbeats and
collective timeouts) leave the CPU idle; run in series with the CPU-bound tiers they doubled the wall time on a
2-core machine. Tests marked `one_core` (the docs tier, long single-process runs) use one core of two. Both kinds
run in the side lane beside the compute lane (many-process tests and the unit tier), with the few long tests
marked `side_lane`, which even the two lanes' wall times (the suite's time is the longer lane's): the compute lane's output
streams live, the side lane's is printed when both have ended, then one closing line with the totals. The exit
code is non-zero when either lane failed. Arguments after `--` go to both pytest runs (e.g. `-k resume`, `-x`).

    python tools/run_suite.py [--serial] [-- PYTEST_ARGS...]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = [sys.executable, "-m", "pytest", "-q", "-rs", "--timeout", "900"]
SIDE = "waits or one_core or side_lane"
ONE_PROCESS_TIERS = ("unit",)


def compute_lane_paths() -> list[str]:
    """The test folders in the order the compute lane runs them: the one-process unit tier first, beside the side
    lane, then the tiers of many processes (forked ranks, torchrun jobs), which have both cores to themselves once
    the side lane ends. The other way round, the unit tier ran last on one core (45% idle for two minutes); and the
    side lane held only `waits` until a one-core test ran alone after it for 80 s (now marked `one_core`)."""
    folders = sorted(p.name for p in (REPO / "tests").iterdir() if p.is_dir() and any(p.glob("test_*.py")))
    ordered = [f for f in ONE_PROCESS_TIERS if f in folders] + [f for f in folders if f not in ONE_PROCESS_TIERS]
    return [f"tests/{f}" for f in ordered]


def compile_bytecode() -> None:
    """Write the bytecode of git's tracked modules once, before the lanes start (into the __pycache__ folders git
    ignores). Where PYTHONDONTWRITEBYTECODE is set (this project's machines set it) no import writes any, so every one
    of the suite's Python processes (the lanes, torchrun jobs, Slurm ranks, CLI runs) and every forked rank compiled
    each project module it imported from source; they read these instead. Outside a git checkout: nothing to do."""
    import compileall
    listed = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=REPO, capture_output=True, text=True)
    for path in filter(None, listed.stdout.split("\0") if listed.returncode == 0 else []):
        compileall.compile_file(REPO / path, quiet=1)


COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def totals(text: str) -> dict:
    """The counts of pytest's closing line (the last line that has any)."""
    for line in reversed(text.splitlines()):
        found = COUNTS.findall(line)
        if found and (" in " in line or "no tests ran" in line):
            return {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in found}
    return {}


def sleep_idle_openmp_threads() -> None:
    """OMP_WAIT_POLICY=PASSIVE for the lanes and every process they start, unless set: an OpenMP thread with no work
    sleeps at once instead of spinning first. Each lane runs torch with a thread per core; two lanes on two cores
    (the unit tier's models beside the docs tier's commands, say) spun on the cores the other lane's work waited
    for: that pair took 119 machine CPU-s and the docs tier 43 s, with PASSIVE 90-100 and 25-29 (twice each)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serial", action="store_true", help="one pytest run over the whole suite")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (put them after --)")
    args = parser.parse_args(argv)
    compile_bytecode()
    sleep_idle_openmp_threads()
    if args.serial:
        return subprocess.call(BASE + ["tests"] + args.pytest_args, cwd=REPO)
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as waits_log:
        waits = subprocess.Popen(BASE + ["-m", SIDE, "tests"] + args.pytest_args, cwd=REPO,
                                 stdout=waits_log, stderr=subprocess.STDOUT, text=True)
        # Stream the compute lane live (CI logs and terminals both want progress), keeping a copy to count.
        proc = subprocess.Popen(BASE + ["-m", f"not ({SIDE})", *compute_lane_paths()] + args.pytest_args, cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        compute_text = []
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            compute_text.append(line)
        compute_rc = proc.wait()
        waits_rc = waits.wait()
        waits_log.seek(0)
        waits_text = waits_log.read()
    print(f"\n---- the side lane (-m '{SIDE}': Slurm tier, fail-fast timeouts, docs tier, one-process runs, the launcher's signals) ----")
    sys.stdout.write(waits_text)
    counts = {}
    for lane in ("".join(compute_text), waits_text):
        for kind, n in totals(lane).items():
            counts[kind] = counts.get(kind, 0) + n
    # pytest exits 5 when a lane selects nothing (e.g. `-- -k name` matching one lane only): not a failure.
    ok = all(rc in (0, 5) for rc in (compute_rc, waits_rc)) and (compute_rc, waits_rc) != (5, 5)
    failed = counts.get("failed", 0) + counts.get("error", 0)
    print(f"two lanes in {time.monotonic() - started:.0f} s; pytest exit codes: compute {compute_rc}, waits {waits_rc}")
    skipped = f", {counts['skipped']} skipped" if counts.get("skipped") else ""
    print(f"suite: {counts.get('passed', 0)} passed, {failed} failed{skipped}")
    return 0 if ok and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
