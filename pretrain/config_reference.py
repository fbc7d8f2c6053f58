"""docs/config.md from the section classes: every key with its type, default and docstring.

`python -m pretrain.config_reference > docs/config.md` writes it; tests/unit/test_config_reference.py
fails when the file and the classes differ, or when a key has no docstring.
"""
import ast
import dataclasses
import inspect
import textwrap
import typing

from pretrain.config import Config

HEADER = """# Config reference

Generated from the section classes by `python -m pretrain.config_reference > docs/config.md`; a test
keeps it equal to them. A run reads defaults ← `--config FILE.toml` ← `section.key=value` overrides
(TOML syntax for the value; a bare word is a string); `~section.key` unsets a key, so its default applies
again (e.g. `~data.corpus` beside `data.blend=...` when the TOML file names a corpus). A key that another
key you set makes unused (`data.corpus` beside `data.blend`) is an error naming both. `--print-config`
prints the resolved tree.
"""


def field_docs(cls) -> dict[str, str]:
    """Each field's documentation in a dataclass and its bases: the string literal after `name: T = v`
    (pretrain's sections), else the comment lines right above it (zero3d's)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        source = textwrap.dedent(inspect.getsource(klass))
        lines, body = source.splitlines(), ast.parse(source).body[0].body
        for node, after in zip(body, body[1:] + [None]):
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
                text = after.value.value
            else:
                above, i = [], node.lineno - 2
                while i >= 0 and lines[i].strip().startswith("#"):
                    above.insert(0, lines[i].strip().lstrip("#"))
                    i -= 1
                text = " ".join(above)
            if text.strip():
                docs[node.target.id] = " ".join(text.split())
    return docs


def type_text(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return " \\| ".join(type_text(a) for a in inner) + " \\| none"
    if origin is typing.Literal:
        return " \\| ".join(f'`"{v}"`' if isinstance(v, str) else f"`{str(v).lower()}`" if isinstance(v, bool)
                            else f"`{v}`" for v in typing.get_args(annotation))
    return getattr(annotation, "__name__", str(annotation))


def default_text(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`' if value else '`""`'
    return f"`{value}`"


def reference() -> str:
    """The whole document; raises ValueError naming any key without a docstring."""
    out, missing = [HEADER], []
    for section in dataclasses.fields(Config):
        cls = section.default_factory().__class__
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        summary = " ".join((inspect.getdoc(cls) or "").split())
        summary = "" if summary.startswith(f"{cls.__name__}(") else summary  # dataclass's own signature text
        out += [f"\n## [{section.name}]\n", f"{summary}\n" if summary else "",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            if f.name not in docs:
                missing.append(f"{section.name}.{f.name}")
                continue
            meaning = docs[f.name].replace("|", "\\|")
            out.append(f"| `{section.name}.{f.name}` | {type_text(hints[f.name])} | {default_text(f)} | {meaning} |")
    if missing:
        raise ValueError(f"config keys without a docstring: {', '.join(missing)}; add one under each field")
    return "\n".join(line for line in out if line != "") + "\n"


if __name__ == "__main__":
    print(reference(), end="")
