"""JSON schema (a common subset) -> grammar nodes the JSON matcher walks.

Supported: ``type`` (a name or a list), ``properties``, ``required``, ``additionalProperties`` (bool or schema),
``items`` (one schema), ``minItems`` / ``maxItems``, ``minLength`` / ``maxLength``, ``enum``, ``const``,
``anyOf`` (with at most a sibling ``type``), local non-recursive ``$ref`` (``#/$defs/...``, ``#/definitions/...``)
and the annotations (title, description, default, ...). Anything else (pattern, format, minimum, oneOf, allOf,
...) is refused with a SchemaError naming the keyword and where it is: refusing is the only way to stay sound,
since the matcher would otherwise let the model write values the schema rejects.

What is generated is a subset of what the schema accepts, chosen so the matcher never needs lookahead:
enum / const values are written in one canonical JSON form (compact, keys in the schema's order), integers are
written without fraction or exponent, strings never use surrogate \\u escapes (so lengths count code points
exactly), and every node knows ``min_len``, the fewest bytes that complete it (the token-budget check).
"""
from __future__ import annotations

import json
from typing import Any

from .nodes import ANY, ANY_OBJECT, AnyOf, Arr, Lit, Node, Num, Obj, SchemaError, Str, dumps

__all__ = ["ANY", "ANY_OBJECT", "AnyOf", "Arr", "Lit", "Node", "Num", "Obj", "SchemaError", "Str", "compile_schema",
           "dumps", "inline_refs", "restrict"]

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "$defs", "definitions"})
KEYWORDS = ANNOTATIONS | {"type", "enum", "const", "properties", "required", "additionalProperties", "items",
                          "minItems", "maxItems", "minLength", "maxLength", "anyOf", "$ref"}
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def _kind(node: Node) -> set[str]:
    """JSON types a node can produce (Lit: those of its options)."""
    if isinstance(node, Obj):
        return {"object"}
    if isinstance(node, Arr):
        return {"array"}
    if isinstance(node, Str):
        return {"string"}
    if isinstance(node, Num):
        return {"integer"} if node.integer else {"number"}
    return set()


def restrict(node: Node | None, types: set[str]) -> Node | None:
    """``node`` limited to the JSON ``types`` (an anyOf branch under a sibling ``type``); None when nothing is left."""
    if node is None:
        return None
    if isinstance(node, AnyOf):
        alts = tuple(a for a in (restrict(x, types) for x in node.alts) if a is not None)
        return None if not alts else alts[0] if len(alts) == 1 else AnyOf(alts)
    if isinstance(node, Lit):
        keep = tuple(o for o in node.options if _json_type(json.loads(o)) & types)
        return Lit(keep) if keep else None
    if isinstance(node, Num) and not node.integer and "number" not in types:
        return Num(True) if "integer" in types else None
    return node if _kind(node) & (types | ({"integer"} if "number" in types else set())) else None


def _json_type(v: Any) -> set[str]:
    if v is None:
        return {"null"}
    if isinstance(v, bool):
        return {"boolean"}
    if isinstance(v, int):
        return {"integer", "number"}
    if isinstance(v, float):
        return {"number", "integer"} if v.is_integer() else {"number"}
    return {"string" if isinstance(v, str) else "array" if isinstance(v, list) else "object"}


def compile_schema(schema: Any) -> Node:
    """The grammar node of a JSON schema; SchemaError for what the subset does not cover."""
    node = _Compiler(schema).node(schema, "#", ())
    if node is None:
        raise SchemaError("the schema accepts no value at all")
    return node


class _Compiler:
    def __init__(self, root: Any):
        self.root = root

    def node(self, s: Any, path: str, refs: tuple[str, ...]) -> Node | None:
        if s is True:
            return ANY
        if s is False:
            return None
        if not isinstance(s, dict):
            raise SchemaError(f"{path}: a schema must be an object or a boolean, not {type(s).__name__}")
        unknown = sorted(set(s) - KEYWORDS)
        if unknown:
            raise SchemaError(f"{path}: unsupported JSON-schema keyword(s) {', '.join(map(repr, unknown))}; guided "
                              f"decoding supports {', '.join(sorted(KEYWORDS - ANNOTATIONS))} and annotations")
        if "$ref" in s:
            return self._ref(s, path, refs)
        if "enum" in s or "const" in s:
            return self._enum(s, path)
        if "anyOf" in s:
            return self._any_of(s, path, refs)
        types = self._types(s, path)
        if types is None:
            return ANY
        nodes = [n for n in (self._typed(t, s, path, refs) for t in types) if n is not None]
        return None if not nodes else nodes[0] if len(nodes) == 1 else AnyOf(tuple(nodes))

    def _types(self, s: dict, path: str) -> list[str] | None:
        t = s.get("type")
        if t is None:  # no type: the keywords present say what is meant (writing that type is always valid)
            if {"properties", "required", "additionalProperties"} & set(s):
                return ["object"]
            if {"items", "minItems", "maxItems"} & set(s):
                return ["array"]
            return ["string"] if {"minLength", "maxLength"} & set(s) else None
        names = [t] if isinstance(t, str) else t
        if not isinstance(names, list) or not names or any(n not in TYPES for n in names):
            raise SchemaError(f"{path}/type: {t!r} is not a JSON-schema type or a list of them ({', '.join(TYPES)})")
        if "integer" in names and "number" in names:
            names = [n for n in names if n != "integer"]
        return list(dict.fromkeys(names))

    def _typed(self, t: str, s: dict, path: str, refs: tuple[str, ...]) -> Node | None:
        if t == "object":
            return self._object(s, path, refs)
        if t == "array":
            items = s.get("items", True)
            if isinstance(items, list):
                raise SchemaError(f"{path}/items: the tuple form (a list of schemas) is not supported")
            node = self.node(items, f"{path}/items", refs)
            lo, hi = self._count(s, "minItems", path), self._count(s, "maxItems", path)
            if node is None:
                hi = 0
            if hi is not None and lo > hi:
                raise SchemaError(f"{path}: minItems {lo} > maxItems {hi} (or items: false)")
            return Arr(node, lo, hi)
        if t == "string":
            lo, hi = self._count(s, "minLength", path), self._count(s, "maxLength", path)
            if hi is not None and lo > hi:
                raise SchemaError(f"{path}: minLength {lo} > maxLength {hi}")
            return Str(lo, hi)
        if t in ("number", "integer"):
            return Num(t == "integer")
        return Lit((b"true", b"false")) if t == "boolean" else Lit((b"null",))

    def _count(self, s: dict, key: str, path: str) -> Any:
        v = s.get(key)
        if v is None:
            return 0 if key.startswith("min") else None
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise SchemaError(f"{path}/{key}: {v!r} is not a non-negative integer")
        return v

    def _object(self, s: dict, path: str, refs: tuple[str, ...]) -> Node:
        props = s.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"{path}/properties: must be an object")
        nodes = {k: self.node(v, f"{path}/properties/{k}", refs) for k, v in props.items()}
        extra = self.node(s.get("additionalProperties", True), f"{path}/additionalProperties", refs)
        req = s.get("required", [])
        if not isinstance(req, list) or not all(isinstance(r, str) for r in req):
            raise SchemaError(f"{path}/required: must be a list of property names")
        for r in req:
            if (nodes[r] if r in nodes else extra) is None:
                raise SchemaError(f"{path}/required: property {r!r} is required but not allowed")
        return Obj(nodes, frozenset(req), extra)

    def _enum(self, s: dict, path: str) -> Node | None:
        import jsonschema

        if "enum" in s and (not isinstance(s["enum"], list) or not s["enum"]):
            raise SchemaError(f"{path}/enum: must be a non-empty list")
        values = [s["const"]] if "const" in s else s["enum"]
        # the other keywords still apply: keep the values the whole schema accepts
        full = {**s, **{k: self.root[k] for k in ("$defs", "definitions") if isinstance(self.root, dict)
                        and k in self.root and k not in s}}
        check = jsonschema.Draft202012Validator(full)
        opts = tuple(dumps(v) for v in values if check.is_valid(v))
        if not opts:
            raise SchemaError(f"{path}: no enum / const value satisfies the rest of the schema")
        return Lit(opts)

    def _any_of(self, s: dict, path: str, refs: tuple[str, ...]) -> Node | None:
        alts = s["anyOf"]
        if not isinstance(alts, list) or not alts:
            raise SchemaError(f"{path}/anyOf: must be a non-empty list of schemas")
        others = sorted(set(s) - ANNOTATIONS - {"anyOf", "type"})
        if others:
            raise SchemaError(f"{path}: anyOf next to {', '.join(map(repr, others))} is not supported (move them "
                              f"into each anyOf branch)")
        nodes = [self.node(a, f"{path}/anyOf/{i}", refs) for i, a in enumerate(alts)]
        types = self._types({"type": s["type"]}, path) if "type" in s else None
        if types is not None:
            nodes = [restrict(n, set(types)) for n in nodes]
        flat: list[Node] = []
        for n in nodes:
            flat += list(n.alts) if isinstance(n, AnyOf) else [n] if n is not None else []
        return None if not flat else flat[0] if len(flat) == 1 else AnyOf(tuple(flat))

    def _ref(self, s: dict, path: str, refs: tuple[str, ...]) -> Node | None:
        ref = s["$ref"]
        others = sorted(set(s) - ANNOTATIONS - {"$ref"})
        if others:
            raise SchemaError(f"{path}: $ref next to {', '.join(map(repr, others))} is not supported")
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"{path}/$ref: only local references ('#/$defs/...') are supported, not {ref!r}")
        if ref in refs:
            raise SchemaError(f"{path}/$ref: {ref!r} is recursive; recursive schemas are not supported")
        target: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"{path}/$ref: {ref!r} does not resolve")
            target = target[part]
        return self.node(target, ref, refs + (ref,))


def inline_refs(schema: Any) -> Any:
    """``schema`` with its local ``$ref``s replaced by their targets and ``$defs`` dropped, so it can be nested
    in a larger schema (a tool's parameters inside a tool-call schema). Recursive references: SchemaError."""
    def walk(s: Any, refs: tuple[str, ...]) -> Any:
        if not isinstance(s, dict):
            return s
        if isinstance(s.get("$ref"), str) and s["$ref"].startswith("#"):
            ref = s["$ref"]
            if ref in refs:
                raise SchemaError(f"$ref {ref!r} is recursive; recursive schemas are not supported")
            target: Any = schema
            for part in [p.replace("~1", "/").replace("~0", "~") for p in ref[1:].split("/") if p]:
                if not isinstance(target, dict) or part not in target:
                    raise SchemaError(f"$ref {ref!r} does not resolve")
                target = target[part]
            if not set(s) - ANNOTATIONS - {"$ref"}:  # else compile_schema refuses the siblings
                return walk(target, refs + (ref,))
        out = {k: v for k, v in s.items() if k not in ("$defs", "definitions")}
        for k in ("items", "additionalProperties"):
            if k in out:
                out[k] = walk(out[k], refs)
        if isinstance(out.get("properties"), dict):
            out["properties"] = {name: walk(v, refs) for name, v in out["properties"].items()}
        if isinstance(out.get("anyOf"), list):
            out["anyOf"] = [walk(v, refs) for v in out["anyOf"]]
        return out

    return walk(schema, ())
