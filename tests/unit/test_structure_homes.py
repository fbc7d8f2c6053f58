"""Issue #54's rules, read from the source: code that tools reading it line by line can follow (no backslash line
continuations); the analysis beside the engine, imported by neither the engine nor the config's ground floor; one
home for the cluster's shape (one rank → node rule); a communication mode named in its card and the few files that
run it."""
import io
import os
import tokenize
from pathlib import Path

from test_structure import REPO

# Files whose continuation lines are still to be joined, each with its reason; the test holds this list exact, so
# an entry goes when its file is mended.
CONTINUATIONS_LEFT: dict = {}


def project_python() -> list[Path]:
    """Every .py file of the project: its packages, tests, tools, benchmarks and examples (not hidden folders, the
    virtual environment, run directories or caches)."""
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("runs", "build", "__pycache__"))
        found += [Path(root) / f for f in sorted(files) if f.endswith(".py")]
    return found


def continuation_lines(text: str) -> list[int]:
    """Line numbers that end in a backslash joining them to the next line: outside every string (a string's own
    escaped newline is text, not a continuation) and outside comments."""
    in_string = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.STRING:
            in_string.update(range(tok.start[0], tok.end[0]))  # lines that end inside the string
    return [n for n, line in enumerate(text.splitlines(), 1)
            if line.endswith("\\") and n not in in_string and not line.lstrip().startswith("#")]


def test_continuation_lines_are_found_and_strings_are_not():
    code = ('x = 1 + \\\n    2\n'  # a continuation
            's = """a \\\nb"""\n'  # an escaped newline inside a string
            '# a comment \\\n'
            'y = (1 +\n     2)\n')
    assert continuation_lines(code) == [1]


def test_no_backslash_line_continuations():
    """Issue #54: a backslash continuation hides every definition after it in its file from tools that read the code
    line by line; parentheses join lines instead."""
    found = {}
    for path in project_python():
        lines = continuation_lines(path.read_text())
        if lines:
            found[str(path.relative_to(REPO))] = lines
    assert sorted(found) == sorted(CONTINUATIONS_LEFT), found


def project_imports(module: str, known: dict) -> set:
    """The project modules `module` imports, directly or through others (absolute imports at any depth)."""
    from test_structure import imports, own_module
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        for imported, names in imports(known[m]):
            for target in [imported] + [f"{imported}.{n}" for n in names]:
                t = own_module(target, known)
                if t and t not in seen and t != m:
                    seen.add(t)
                    todo.append(t)
    return seen


def test_the_engine_and_the_configs_ground_floor_reach_no_analysis():
    """Issue #54: the analysis (analysis/) stands beside the engine: nothing under zero3d/, and neither the config's
    sections (pretrain/sections.py) nor its tree (pretrain/config.py), imports it, directly or through another module;
    the model's shape they share is model_shape/, below both."""
    from test_structure import modules
    known = modules()
    reached = {m: sorted(t for t in project_imports(m, known) if t.split(".")[0] == "analysis")
               for m in known if m.split(".")[0] == "zero3d" or m in ("pretrain.sections", "pretrain.config")}
    assert {m: found for m, found in reached.items() if found} == {}
    assert "model_shape.gpt" in project_imports("pretrain.sections", known)


def node_arithmetic(path: Path) -> list[str]:
    """The expressions of a file that place ranks on nodes: a rank or a count divided (// or %) by a number of GPUs per
    node, or a number of GPUs per node divided (//) by a TP size (the DP ranks a node holds)."""
    import ast
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.FloorDiv, ast.Mod)):
            right, left = ast.unparse(node.right), ast.unparse(node.left)
            if "gpus_per_node" in right or (isinstance(node.op, ast.FloorDiv) and "gpus_per_node" in left):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_one_rank_to_node_rule():
    """Issue #54: a rank's node is zero3d/comm/topology.py's `node_of_rank` (and the DP ranks a node holds its
    `dp_ranks_per_node`): no other module of the engine, the analysis or pretrain divides ranks by the GPUs per node
    (the engine's node topology and bytes per link, the memory check and the planner read the one rule)."""
    rule = REPO / "zero3d" / "comm" / "topology.py"
    found = [line for top in ("zero3d", "analysis", "model_shape", "pretrain") for path in sorted((REPO / top).rglob("*.py"))
             if path != rule for line in node_arithmetic(path)]
    assert found == []
    assert [line.split(": ", 1)[1] for line in node_arithmetic(rule)] == ["global_rank // gpus_per_node"]


# The words that name each communication mode in code: its short name and its ZeroConfig key.
MODE_WORDS = {"hpZ": ("hpZ", "secondary_partition"), "hybrid": ("hybrid",), "qwZ": ("qwZ", "quantize_weights"),
              "qgZ": ("qgZ", "quantize_gradients")}
# A mode's homes: its card's two halves (the engine's, the analysis's) and the config section holding its key.
MODE_HOMES = ("zero3d/comm/modes.py", "analysis/modes.py", "zero3d/config.py")


def code_words(text: str) -> str:
    """A file's names and string literals as code uses them: no comments, no docstrings (module, class, function)."""
    import ast
    docstrings = {node.body[0].lineno for node in ast.walk(ast.parse(text))
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
                  and isinstance(node.body[0].value.value, str)}
    return " ".join(tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                    if tok.type == tokenize.NAME or tok.type == tokenize.STRING and tok.start[0] not in docstrings)


def test_code_words_leave_out_comments_and_docstrings():
    code = '"""hpZ"""\nx = 1  # hpZ\ndef f():\n    """qwZ"""\n    return "qgZ", modes.hybrid\n'
    assert code_words(code).split() == ["x", "def", "f", "return", '"qgZ"', "modes", "hybrid"]


def mode_namers() -> dict:
    """mode → the project's Python files (not tests, not docs) whose code names it, beyond its homes."""
    files = [path for path in project_python() if path.relative_to(REPO).parts[0] not in ("tests", "docs")
             and str(path.relative_to(REPO)) not in MODE_HOMES]
    words = {path: code_words(path.read_text()) for path in files}
    return {mode: sorted(str(path.relative_to(REPO)) for path, text in words.items() if any(w in text for w in names))
            for mode, names in MODE_WORDS.items()}


def test_a_communication_mode_is_named_by_its_card_and_at_most_three_other_files():
    """Issue #54: a mode is a card (zero3d/comm/modes.py: its key, stages and config checks; analysis/modes.py: its
    collectives' α-β costs and its memory terms), which the config, the α-β model and the estimator read; beyond its
    card and its config key, at most 3 files' code names it (the engine code that runs it among them)."""
    namers = mode_namers()
    assert {mode: files for mode, files in namers.items() if len(files) > 3} == {}, namers


def test_every_mode_card_has_its_costs():
    """The engine's half of each card and the analysis's half are keyed by the same names, in one registry each."""
    from analysis.modes import COSTS, ORDER
    from zero3d.comm.modes import CARDS
    assert sorted(COSTS) == sorted(card.name for card in CARDS) == sorted(ORDER) == sorted(MODE_WORDS)
    assert {card.name: card.key for card in CARDS} == {mode: words[-1] for mode, words in MODE_WORDS.items()}
