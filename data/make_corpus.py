"""Builds data/corpus.jsonl from English documentation text that ships with CPython's standard library.

Run once with the project's interpreter (the shipped corpus came from CPython 3.11.7):
    .venv/bin/python data/make_corpus.py
Two sources, both under the PSF licence, read from the interpreter's own stdlib so no download is needed:
  1. pydoc_data/topics.py: the Language Reference topics behind help("assert"), one document per section;
  2. the module docstrings of the pure-Python stdlib modules, one document per module.
The output is deterministic for a given CPython version: topics and files are visited in sorted order.
"""
import ast
import json
import re
import sys
import sysconfig
from pathlib import Path

from pydoc_data.topics import topics

OUTPUT = Path(__file__).resolve().parent / "corpus.jsonl"

# A reST heading as pydoc renders it: a title line, then a rule of *, =, - or ~ of the same length.
HEADING = re.compile(r"^(.+)\n([*=\-~])\2*$", re.M)

# Stdlib trees that are tests, demos or vendored tools rather than documented modules.
SKIPPED_TOP_LEVEL = {"test", "idlelib", "lib2to3", "site-packages", "turtledemo"}


def topic_sections(text: str) -> list[str]:
    """Split one pydoc topic at its headings, so each section (title included) is one document."""
    starts = [m.start() for m in HEADING.finditer(text) if len(m.group(0).split("\n")[1]) == len(m.group(1))]
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
    bounds = starts + [len(text)]
    return [text[a:b].strip() for a, b in zip(bounds, bounds[1:])]


def module_docstrings(stdlib: Path) -> list[str]:
    """The docstring of every stdlib module, parsed with ast so no module is imported."""
    docs = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if rel.parts[0] in SKIPPED_TOP_LEVEL or "tests" in rel.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue  # a few stdlib files are deliberately invalid (bad-syntax fixtures)
        doc = ast.get_docstring(tree)
        if doc:
            docs.append(doc.strip())
    return docs


def main() -> None:
    documents = []
    for name in sorted(topics):
        documents.extend(topic_sections(topics[name]))
    documents.extend(module_docstrings(Path(sysconfig.get_paths()["stdlib"])))
    # Some sections appear under two topics (e.g. augmented assignment); keep each text once.
    unique = list(dict.fromkeys(doc for doc in documents if doc))
    with OUTPUT.open("w", encoding="utf-8") as out:
        for doc in unique:
            out.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    print(f"wrote {len(unique)} documents, {OUTPUT.stat().st_size} bytes to {OUTPUT} "
          f"(CPython {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
