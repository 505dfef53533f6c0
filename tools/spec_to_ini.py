"""Convert a YAML model spec to the equivalent INI spec.

    python tools/spec_to_ini.py model_specs/llama.yaml            # INI on stdout
    python tools/spec_to_ini.py model_specs/llama.yaml -o llama.ini

The INI form is read by ``inferflow.spec.loader.parse_ini``: a section name is a dotted key path
(``[decoder.layers.steps.0]``; numeric parts index lists), ``[spec]`` holds the top-level scalars, and
every value is a YAML flow scalar or collection. Mapping keys that contain dots (the weight templates
under ``weights.hf``) cannot be path parts, so such mappings are written as one flow mapping, one
entry per continuation line. The output is checked to parse back to exactly the input document.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.spec.loader import parse_ini, read_document  # noqa: E402

_PATH_PART = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")   # usable as a section/option path part
_PLAIN = re.compile(r"^[A-Za-z_$][A-Za-z0-9_.\-/]*$")   # a string that may stay unquoted


def _string(s: str) -> str:
    if _PLAIN.match(s) and yaml.safe_load(s) == s:
        return s
    return json.dumps(s)  # a JSON string is a YAML double-quoted scalar, escapes and all


def flow(v: Any) -> str:
    """One value as YAML flow text that ``yaml.safe_load`` reads back as ``v``."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return yaml.safe_dump(v).split("\n")[0]  # YAML 1.1 floats need a dot (1.0e-06), JSON's 1e-06 is a string
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(flow(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{flow(k)}: {flow(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write a {type(v).__name__} value in a spec")


def _sectionable(d: Any) -> bool:
    return isinstance(d, dict) and bool(d) and all(isinstance(k, str) and _PATH_PART.match(k) for k in d)


def _nested(v: Any) -> bool:
    """Values that read better as their own section(s) than as one flow value."""
    if isinstance(v, list):
        return bool(v) and all(_sectionable(x) for x in v)
    return _sectionable(v) and any(isinstance(x, dict) or (isinstance(x, list) and _nested(x)) for x in v.values())


def _option(key: str, v: Any) -> str:
    if isinstance(v, dict) and len(v) > 1 and len(flow(v)) > 100:
        # a long mapping: one entry per continuation line (configparser joins them with newlines)
        body = ",\n".join(f"  {flow(k)}: {flow(x)}" for k, x in v.items())
        return f"{key} = {{\n{body}}}"
    return f"{key} = {flow(v)}"


def _sections(path: list[str], node: dict, out: list[tuple[str, list[str]]]) -> None:
    options, later = [], []
    for k, v in node.items():
        if (not path and _sectionable(v)) or _nested(v):
            if isinstance(v, list):
                later += [(path + [k, str(n)], x) for n, x in enumerate(v)]
            else:
                later.append((path + [k], v))
        else:
            options.append(_option(k, v))
    if options:
        out.append((".".join(path) or "spec", options))
    for p, v in later:
        _sections(p, v, out)


def to_ini(doc: dict, source: str = "") -> str:
    """The INI text of a spec document (raises if it would not parse back to ``doc``)."""
    out: list[tuple[str, list[str]]] = []
    _sections([], doc, out)
    head = f"# Converted from {source} by tools/spec_to_ini.py.\n" if source else ""
    text = head + "\n".join(f"[{name}]\n" + "\n".join(opts) + "\n" for name, opts in out)
    back = parse_ini(text, source or "<converted>")
    if _canon(back) != _canon(doc):
        raise ValueError(f"{source}: the INI form does not read back identically (unsupported key or value)")
    return text


def _canon(v: Any) -> Any:
    # a strict comparison: 1, 1.0 and True must not compare equal
    if isinstance(v, dict):
        return {k: _canon(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_canon(x) for x in v]
    return (type(v).__name__, v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", type=Path, help="a YAML spec file")
    ap.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    args = ap.parse_args(argv)
    text = to_ini(read_document(args.spec), args.spec.name)
    if args.output:
        args.output.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
