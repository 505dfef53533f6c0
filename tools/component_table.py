"""Print the component reference of docs/specs.md from the live registry, so the docs stay true.

    python tools/component_table.py                          # markdown on stdout
    python tools/component_table.py --write docs/specs.md    # replace the table between the markers
    python tools/component_table.py --check docs/specs.md    # exit 1 if the doc's table is stale

Every registered component is listed with its module, the first line of its docstring (or of its
module's) and its parameters: name, type and default (required when there is none).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow import registry  # noqa: E402

BEGIN, END = "<!-- component-table:begin -->", "<!-- component-table:end -->"


def _type_name(t: object) -> str:
    if t is type(None):
        return "None"
    if isinstance(t, type):
        return t.__name__
    args = typing.get_args(t)
    if args and (typing.get_origin(t) is typing.Union or type(t).__name__ == "UnionType"):
        return " \\| ".join(_type_name(a) for a in args)  # escaped for markdown tables
    return str(t).replace("typing.", "").replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        return f"`{f.default_factory()!r}`"
    return "**required**"


def _summary(cls: type) -> str:
    doc = inspect.getdoc(cls)
    if not doc or doc == inspect.getdoc(cls.__mro__[1]):  # inherited from Component: use the module's
        doc = inspect.getdoc(sys.modules[cls.__module__]) or ""
    return " ".join(doc.split("\n\n")[0].split()).replace("|", "\\|")


def table() -> str:
    lines = ["| component | module | what it does | parameters (type = default) |", "|---|---|---|---|"]
    for name in registry.names():
        cls = registry.get(name)
        hints = typing.get_type_hints(cls.Params)
        params = "<br>".join(f"`{f.name}`: {_type_name(hints.get(f.name, typing.Any))} = {_default(f)}"
                             for f in dataclasses.fields(cls.Params)) or "(none)"
        module = cls.__module__.rsplit(".", 1)[-1]
        lines.append(f"| `{name}` | {module}.py | {_summary(cls)} | {params} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--check", type=Path, help="a markdown file whose table (between the markers) must be current")
    group.add_argument("--write", type=Path, help="a markdown file whose table (between the markers) to replace")
    args = ap.parse_args(argv)
    text = table()
    path = args.check or args.write
    if path is None:
        sys.stdout.write(text)
        return 0
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        print(f"{path}: no {BEGIN} ... {END} markers", file=sys.stderr)
        return 1
    head, rest = doc.split(BEGIN, 1)
    current, tail = rest.split(END, 1)
    if args.write:
        path.write_text(f"{head}{BEGIN}\n{text}{END}{tail}")
        return 0
    if current.strip() != text.strip():
        print(f"{path}: the component table is stale; run python tools/component_table.py --write {path}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
