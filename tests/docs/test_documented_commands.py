"""The docs tier: every command README.md, slurm/README.md and docs/*.md mark runnable runs, exits as marked
and prints its key line (a doc edit changes the test; a behaviour change fails it)."""
import pytest

from doc_commands import DocTestError, check, documented_commands, extract

COMMANDS = documented_commands()


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_documented_command(cmd, results):
    if cmd.needs:  # a failure of what this command reads is reported as that failure
        (setup,) = [c for c in COMMANDS if c.setup]
        check(setup, results[setup.id])
        for needed in [c for c in COMMANDS if c.name and c.name == cmd.needs]:
            check(needed, results[needed.id])
    check(cmd, results[cmd.id])


def test_every_doc_with_commands_marks_some_and_markers_parse():
    by_source = {c.source for c in COMMANDS}
    assert {"README.md", "slurm/README.md", "docs/estimator.md"} <= by_source
    assert len(COMMANDS) >= 15


def test_markers_are_checked():
    good = '<!-- doc-test: exit=2 expect="a b" expect="c" -->\n```bash\npython x.py --y \\\n  --z  # comment\n```\n'
    (cmd,) = extract("doc.md", good)
    assert (cmd.exit, cmd.expect, cmd.argv, cmd.line) == (2, ["a b", "c"], ["python", "x.py", "--y", "--z"], 3)
    with pytest.raises(DocTestError, match="doc.md:1: a doc-test block holds exactly one command; found 2"):
        extract("doc.md", "<!-- doc-test: exit=0 -->\n```bash\na\nb\n```\n")
    (named, reader) = extract("doc.md", '<!-- doc-test: name=out exit=0 -->\n```bash\na\n```\n'
                                        '<!-- doc-test: needs=out exit=0 -->\n```bash\nb\n```\n')
    assert (named.name, reader.needs) == ("out", "out")
    with pytest.raises(DocTestError, match="unknown doc-test attribute 'exitcode'"):
        extract("doc.md", "<!-- doc-test: exitcode=0 -->\n```bash\na\n```\n")
    with pytest.raises(DocTestError, match="followed directly by a fenced block"):
        extract("doc.md", "<!-- doc-test: exit=0 -->\ntext\n```bash\na\n```\n")
