"""`make mutants`: apply each curated one-line bug of tests/mutants.toml to a copy of the tree, run its tests, table the kills."""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "tests" / "mutants.toml"
FIELDS = {"name", "promise", "file", "search", "replace", "tests"}


class MutantError(Exception):
    """A mutant that cannot be applied as written (its search text is gone, or matches twice)."""


def load(path: Path = LIST) -> list[dict]:
    """The mutants, each checked for its fields; names unique."""
    with open(path, "rb") as f:
        mutants = tomllib.load(f).get("mutant", [])
    seen = set()
    for i, m in enumerate(mutants):
        if set(m) != FIELDS:
            raise MutantError(f"{path}: mutant #{i + 1} has fields {sorted(m)}; needs exactly {sorted(FIELDS)}")
        if m["name"] in seen:
            raise MutantError(f"{path}: mutant name {m['name']!r} is used twice")
        if "\n" in m["search"] or "\n" in m["replace"] or m["search"] == m["replace"] or not m["tests"]:
            raise MutantError(f"{path}: mutant {m['name']!r} must replace one line with another and name its tests")
        seen.add(m["name"])
    return mutants


def mutate(text: str, mutant: dict) -> str:
    """`text` with the mutant's search text replaced; the search text must occur exactly once."""
    count = text.count(mutant["search"])
    if count != 1:
        raise MutantError(f"mutant {mutant['name']!r}: search text {mutant['search']!r} occurs {count} times in "
                          f"{mutant['file']} (needs exactly 1): update tests/mutants.toml to the code's new line")
    return text.replace(mutant["search"], mutant["replace"])


def check_all(root: Path, mutants: list[dict]) -> None:
    """Every mutant applies to the tree at `root` (raises MutantError naming the first that does not)."""
    for m in mutants:
        mutate((root / m["file"]).read_text(), m)


def missing_tests(root: Path, mutants: list[dict]) -> list[str]:
    """The named tests pytest does not collect in the tree at `root` ("mutant: id"): a renamed test, or a docs-tier
    id whose line number moved, would make its mutant an error instead of a kill. An id names a file, a test, or one
    of a parametrized test's cases."""
    ids = sorted({t for m in mutants for t in m["tests"]})
    files = sorted({t.split("::")[0] for t in ids})
    proc = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-m", "pytest", "-q", "--collect-only",
                           "-p", "no:cacheprovider", *files], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                          capture_output=True, text=True)
    collected = {line.strip() for line in proc.stdout.splitlines() if "::" in line}
    found = {t for t in ids if t in files or t in collected or any(c.startswith(t + "[") for c in collected)}
    return [f"{m['name']}: {t}" for m in mutants for t in m["tests"] if t not in found]


def copy_tree(dest: Path) -> None:
    """Tracked and untracked-but-not-ignored files of the worktree (no venv, no runs/)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_tests(tree: Path, tests: list[str], timeout: float) -> tuple[str, float, str]:
    """(outcome, seconds, detail): 'killed' when a named test fails (every named test runs, and the
    detail names those that failed), 'survived' when all pass."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [str(ROOT / ".venv" / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
           "--timeout", str(int(timeout)), *tests]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        return "killed (timeout)", time.monotonic() - start, ""
    seconds = time.monotonic() - start
    tail = (proc.stdout + proc.stderr)[-3000:]
    if proc.returncode == 0:
        return "survived", seconds, tail
    if proc.returncode in (1, 2):  # tests failed, or collection broke under the mutant
        failed = [line.split(" - ")[0] for line in (proc.stdout + proc.stderr).splitlines()
                  if line.startswith(("FAILED ", "ERROR "))]
        summary = (proc.stdout + proc.stderr).strip().splitlines()[-1:]  # "2 failed, 1 passed in 9.1s"
        return "killed", seconds, "\n    ".join(failed + summary)
    return f"error (pytest exit {proc.returncode})", seconds, tail


def run_one(tree: Path, m: dict, timeout: float) -> tuple[str, float, str]:
    """The mutant applied to `tree`, its tests run, the file restored."""
    path = tree / m["file"]
    original = path.read_text()
    path.write_text(mutate(original, m))
    try:
        return run_tests(tree, m["tests"], timeout)
    finally:
        path.write_text(original)


def run_all(mutants: list[dict], trees: list[Path], timeout: float) -> list[tuple]:
    """[(mutant, outcome, seconds)] in the list's order, len(trees) mutants at a time, each in a tree of its own."""
    import queue
    import threading
    free, results, lock = queue.Queue(), {}, threading.Lock()
    for tree in trees:
        free.put(tree)

    def work(i: int, m: dict) -> None:
        tree = free.get()
        try:
            outcome, seconds, tail = run_one(tree, m, timeout)
        finally:
            free.put(tree)
        with lock:
            results[i] = (m, outcome, seconds)
            print(f"[{len(results)}/{len(mutants)}] {m['name']}: {outcome} ({seconds:.0f} s)", flush=True)
            print(f"    {tail}" if outcome == "killed" else tail, flush=True)  # what failed, or why not

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=len(trees)) as pool:
        list(pool.map(work, range(len(mutants)), mutants))
    return [results[i] for i in range(len(mutants))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("-k", dest="only", action="append", default=[], help="run only mutants whose name contains this")
    ap.add_argument("--check", action="store_true", help="only check that every mutant applies to this tree")
    ap.add_argument("--baseline", action="store_true", help="first run each mutant's tests on the unmutated copy")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per mutant's test run")
    ap.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in a copy of its own (default 1)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs} is invalid; must be >= 1")
    mutants = [m for m in load() if not args.only or any(k in m["name"] for k in args.only)]
    try:
        check_all(ROOT, mutants)
    except MutantError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.check:
        missing = missing_tests(ROOT, mutants)
        if missing:
            print("error: tests/mutants.toml names tests that do not exist:\n  " + "\n  ".join(missing), file=sys.stderr)
            return 2
        print(f"{len(mutants)} mutants apply to {ROOT}, and each names tests that exist")
        return 0
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zero3d-mutants-") as tmp:
        trees = [Path(tmp) / f"tree{j}" for j in range(args.jobs)]
        for tree in trees:
            tree.mkdir()
            copy_tree(tree)
        probe = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", "import zero3d; print(zero3d.__file__)"],
                               cwd=trees[0], env={**os.environ, "PYTHONPATH": str(trees[0])}, capture_output=True,
                               text=True)
        if not probe.stdout.strip().startswith(str(trees[0])):
            print(f"error: the copy does not import its own zero3d ({probe.stdout.strip() or probe.stderr[-500:]})",
                  file=sys.stderr)
            return 2
        if args.baseline:
            tests = sorted({t for m in mutants for t in m["tests"]})
            outcome, seconds, tail = run_tests(trees[0], tests, args.timeout * 4)
            print(f"baseline ({len(tests)} test ids): {outcome} in {seconds:.0f} s", flush=True)
            if outcome != "survived":
                print(tail)
                return 1
        rows = run_all(mutants, trees, args.timeout)
    total = time.monotonic() - began
    width = max(len(m["name"]) for m, _, _ in rows)
    print(f"\n| {'mutant'.ljust(width)} | result   | s    | promise |")
    print(f"| {'-' * width} | -------- | ---- | ------- |")
    for m, outcome, seconds in rows:
        print(f"| {m['name'].ljust(width)} | {outcome.ljust(8)} | {seconds:4.0f} | {m['promise']} |")
    killed = sum(outcome.startswith("killed") for _, outcome, _ in rows)
    print(f"\n{killed}/{len(rows)} killed; total {total:.0f} s")
    return 0 if killed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
