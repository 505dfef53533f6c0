"""Turning JSON Schema validation errors into one short, spec-author-facing message.

jsonschema reports ``oneOf`` failures as "X is not valid under any of the given schemas" and
types as "'abc' is not of type 'integer'"; a spec author wants "expected an integer or a
$name/${expression}, got str 'abc'" and the key path of the offending value.
"""
from __future__ import annotations

import difflib
import re
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

_TYPE_WORDS = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "a boolean",
               "null": "null", "array": "a list", "object": "a mapping"}
_EXPR_PATTERN = "^\\s*\\$"
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def key_path(parts: Any) -> str:
    """``['decoder', 'layers', 'steps', 0, 'eps']`` -> ``decoder.layers.steps[0].eps``."""
    out = ""
    for part in parts:
        if isinstance(part, int) or not _IDENT.match(str(part)):
            out += f"[{part}]" if isinstance(part, int) else f"[{part!r}]"  # weights.hf['model.layers.{i}']
        else:
            out += f".{part}" if out else str(part)
    return out or "(top level)"


def _deref(sub: Any, root: dict) -> Any:
    while isinstance(sub, dict) and "$ref" in sub and sub["$ref"].startswith("#/$defs/"):
        sub = root["$defs"][sub["$ref"][len("#/$defs/"):]]
    return sub


def describe(sub: Any, root: dict) -> str:
    """A few words for what a (sub)schema accepts."""
    sub = _deref(sub, root)
    if not isinstance(sub, dict):
        return "a value"
    for alt in ("oneOf", "anyOf"):
        if alt in sub:
            words = []
            for s in sub[alt]:
                w = describe(s, root)
                if w not in words:
                    words.append(w)
            return " or ".join(words)
    if "enum" in sub:
        return "one of " + ", ".join(repr(v) for v in sub["enum"])
    if sub.get("pattern") == _EXPR_PATTERN:
        return "a $name/${expression}"
    typ = sub.get("type")
    if isinstance(typ, list):
        return " or ".join(_TYPE_WORDS.get(t, t) for t in typ)
    if typ == "array" and _deref(sub.get("items"), root) == {"type": "string"}:
        return "a list of strings"
    if typ == "integer" and sub.get("minimum") == 0:
        return "a non-negative integer"
    return _TYPE_WORDS.get(typ, "a value") if typ else "a value"


def _got(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def explain(errors: list[jsonschema.ValidationError], root: dict) -> tuple[str, str]:
    """(key path, problem) for the most relevant of ``errors``."""
    err = best_match(errors)
    path = list(err.absolute_path)
    # every alternative of a oneOf failed at this very value: describe the alternatives, not the last one tried
    parent = err.parent
    if (parent is not None and parent.validator in ("oneOf", "anyOf") and list(parent.absolute_path) == path
            and err.validator in ("type", "pattern", "oneOf", "anyOf")):
        err = parent
    if err.validator in ("oneOf", "anyOf", "type", "pattern"):
        return key_path(path), f"expected {describe(err.schema, root)}, got {_got(err.instance)}"
    if err.validator == "required":
        missing = [k for k in err.validator_value if k not in err.instance]
        return key_path(path), f"missing required key {missing[0]!r}" if missing else err.message
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        allowed = list(err.schema.get("properties", {}))
        extra = [k for k in err.instance if k not in allowed]
        if extra and allowed:
            bad = extra[0]
            close = difflib.get_close_matches(str(bad), allowed, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            return key_path(path + [bad]), f"unknown key {bad!r} ({hint}allowed: {', '.join(allowed)})"
        return key_path(path), f"unknown key: {err.message}"
    return key_path(path), err.message
