"""Resolving a spec's hyper-parameters from a model's config (config.json, GGUF metadata, ...)."""
from __future__ import annotations

from typing import Any, Mapping

from ..errors import SpecError
from .expr import resolve
from .loader import Spec

_MISSING = object()
_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "list": list, "dict": dict}


def lookup(config: Mapping[str, Any], key: str) -> Any:
    """``a.b.c`` walks nested dicts; a key present with a null value counts as absent."""
    if key in config:  # flat dotted keys (GGUF metadata: "llama.block_count")
        return _MISSING if config[key] is None else config[key]
    # a prefix of flat dotted keys gathers them into a dict ("{arch}.rope.scaling" -> {"type": ..., "factor": ...})
    prefix = key + "."
    group = {k[len(prefix):]: v for k, v in config.items() if isinstance(k, str) and k.startswith(prefix)
             and v is not None}
    if group:
        return group
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return _MISSING if node is None else node


def _coerce(value: Any, typ: str | None, file: str, key: str) -> Any:
    if typ in (None, "any") or value is None:
        return value
    want = _TYPES[typ]
    if typ == "float" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ == "int" and isinstance(value, float) and value.is_integer():
        return int(value)
    if typ == "bool" and isinstance(value, int) and value in (0, 1):
        return bool(value)
    if typ == "list" and isinstance(value, tuple):
        return list(value)
    if not isinstance(value, want) or (typ in ("int", "float") and isinstance(value, bool)):
        raise SpecError(file, key, f"expected {typ}, got {type(value).__name__} {value!r}")
    return value


def resolve_params(spec: Spec, kind: str, config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None,
                   *, config_name: str = "config.json", arch: str | None = None) -> dict[str, Any]:
    """Evaluate ``spec.params`` in order; ``kind`` picks the source keys (``hf`` or ``gguf``)."""
    overrides = dict(overrides or {})
    unknown = set(overrides) - set(spec.data.get("params", {}))
    if unknown:
        raise SpecError(spec.file, "params", f"unknown override(s) {sorted(unknown)} (spec params: "
                        f"{', '.join(spec.data.get('params', {}))})")
    out: dict[str, Any] = {}
    for name, decl in spec.data.get("params", {}).items():
        key = f"params.{name}"
        where = (spec.file, key)
        if name in overrides:
            out[name] = overrides[name]
            continue
        if not isinstance(decl, dict):
            out[name] = resolve(decl, out, where=where)
            continue
        value = _MISSING
        if "expr" in decl:
            value = resolve(decl["expr"], out, where=where)
        else:
            # Sources without their own key family (llama2c) expose their config under HF names.
            keys = decl.get(kind, []) if kind in ("hf", "gguf") else decl.get(kind, decl.get("hf", []))
            keys = [keys] if isinstance(keys, str) else keys
            for k in keys:
                value = lookup(config, k.replace("{arch}", arch or ""))
                if value is not _MISSING:
                    break
            if value is _MISSING:
                if "default" in decl:
                    value = resolve(decl["default"], out, where=where)
                elif decl.get("required", True):
                    looked = f" (looked for {', '.join(keys)})" if keys else ""
                    raise SpecError(spec.file, key, f"not found in {config_name}{looked} and no default given")
                else:
                    value = None
        out[name] = _coerce(value, decl.get("type"), spec.file, key)
    return out
