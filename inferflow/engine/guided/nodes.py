"""Grammar nodes: what the JSON matcher (json_matcher.py) walks, built by the schema compiler (schema.py).

Each node knows ``min_len``, the fewest bytes that write a value of it (the token-budget check). Fixed values
(enum, const, true/false/null, guided_choice, template text) are Lit nodes of exact byte strings, written in one
canonical JSON form.
"""
from __future__ import annotations

import json
from typing import Any

from ...errors import InferflowError


class SchemaError(InferflowError):
    """A schema guided decoding cannot honour (unsupported keyword, unsatisfiable, malformed): a 400."""


class Node:
    __slots__ = ("min_len",)


class Obj(Node):
    """An object: ``props`` name -> Node (None: the key is forbidden), ``additional`` Node or None (closed)."""

    __slots__ = ("props", "required", "additional", "keys", "names", "entry", "max_value_len")

    def __init__(self, props: dict[str, Node | None], required: frozenset[str], additional: Node | None):
        self.props, self.required, self.additional = props, required, additional
        self.keys = {k: dumps(k) for k in props}                 # canonical key literal, quotes included
        self.names = {v: k for k, v in self.keys.items()}
        # bytes of '"name":<shortest value>' per property, for the budget
        self.entry = {k: len(self.keys[k]) + 1 + v.min_len for k, v in props.items() if v is not None}
        vals = [v.min_len for v in props.values() if v is not None] + ([additional.min_len] if additional else [])
        self.max_value_len = max(vals, default=1)
        self.min_len = 2 + sum(self.entry_of(k) for k in required) + max(0, len(required) - 1)

    def value(self, name: str) -> Node | None:
        return self.props[name] if name in self.props else self.additional

    def entry_of(self, name: str) -> int:
        if name in self.entry:
            return self.entry[name]
        return len(dumps(name)) + 1 + (self.additional.min_len if self.additional else 1)


class Arr(Node):
    __slots__ = ("items", "min_items", "max_items")

    def __init__(self, items: Node | None, min_items: int = 0, max_items: int | None = None):
        self.items, self.min_items, self.max_items = items, min_items, max_items
        m = items.min_len if items is not None else 0
        self.min_len = 2 + min_items * m + max(0, min_items - 1)


class Str(Node):
    __slots__ = ("min_chars", "max_chars")

    def __init__(self, min_chars: int = 0, max_chars: int | None = None):
        self.min_chars, self.max_chars = min_chars, max_chars
        self.min_len = 2 + min_chars


class Num(Node):
    __slots__ = ("integer",)

    def __init__(self, integer: bool):
        self.integer, self.min_len = integer, 1


class Lit(Node):
    """One of a few exact byte strings (true/false/null, enum values, guided_choice, fixed text)."""

    __slots__ = ("options",)

    def __init__(self, options: tuple[bytes, ...]):
        self.options = tuple(dict.fromkeys(o for o in options if o))
        self.min_len = min(len(o) for o in self.options)


class AnyOf(Node):
    __slots__ = ("alts",)

    def __init__(self, alts: tuple[Node, ...], min_len: int | None = None):
        self.alts = alts
        self.min_len = min(a.min_len for a in alts) if min_len is None else min_len


def dumps(value: Any) -> bytes:
    """The one JSON form guided decoding writes for a fixed value (compact; raw UTF-8 where encodable)."""
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: keep them escaped
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("ascii")
    except ValueError as e:
        raise SchemaError(f"value {value!r} cannot be written as JSON: {e}") from None


def _any() -> AnyOf:
    """Any JSON value (objects with any keys, nested without limit)."""
    anything = AnyOf((), min_len=1)
    anything.alts = (Obj({}, frozenset(), anything), Arr(anything), Str(), Num(False),
                     Lit((b"true", b"false", b"null")))
    return anything


ANY = _any()
ANY_OBJECT = ANY.alts[0]
