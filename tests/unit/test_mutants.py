"""tests/mutants.toml stays applicable: every mutant's search text is in the tree exactly once; a missing one fails loudly."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import mutants  # noqa: E402


def test_every_mutant_applies_to_this_tree():
    listed = mutants.load()
    assert len(listed) >= 16
    mutants.check_all(ROOT, listed)
    for m in listed:
        for test in m["tests"]:
            assert (ROOT / test.split("::")[0]).is_file(), f"{m['name']}: {test} names no test file"


@pytest.mark.one_core  # collects every test file a mutant names: one process for ~20 s
def test_every_mutant_names_tests_that_are_collected():
    """A test id that no longer exists (a renamed test, a docs-tier id whose line moved) made its mutant an error
    in `make mutants` (seen: slurm/README.md:501 after the README grew); ids are checked against pytest's own
    collection, and one made up for the purpose is caught."""
    listed = mutants.load()
    gone = dict(listed[0], tests=["tests/docs/test_documented_commands.py::test_documented_command[README.md:1]",
                                  listed[0]["tests"][0]])
    # one collection (~10 s) for both: every listed id is found, and only the made-up one is reported
    assert mutants.missing_tests(ROOT, listed + [gone]) == [
        f"{gone['name']}: tests/docs/test_documented_commands.py::test_documented_command[README.md:1]"]


def test_a_search_text_that_is_gone_or_repeated_is_an_error():
    m = {"name": "x", "file": "f.py", "search": "a = 1", "replace": "a = 2"}
    assert mutants.mutate("b = 0\na = 1\n", m) == "b = 0\na = 2\n"
    with pytest.raises(mutants.MutantError, match=r"'a = 1' occurs 0 times in f.py"):
        mutants.mutate("a = 3\n", m)
    with pytest.raises(mutants.MutantError, match="occurs 2 times"):
        mutants.mutate("a = 1\na = 1\n", m)
