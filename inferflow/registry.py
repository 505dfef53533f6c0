"""The component registry: the one extension point through which specs name building blocks.

A component module registers itself with ``@register("name")``; every module of the
``inferflow.components`` package (and of folders listed in $INFERFLOW_COMPONENT_PATH) is imported
on first use, so adding a component means adding a file.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import pkgutil
import sys
import typing
from pathlib import Path
from typing import Any, Callable

from .errors import SpecError

_REGISTRY: dict[str, type] = {}
_loaded = False


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make a component available to specs under ``name``."""

    def deco(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            prev = _REGISTRY[name]
            if (prev.__module__, prev.__qualname__) != (cls.__module__, cls.__qualname__):
                raise ValueError(f"component {name!r} registered twice ({prev.__module__} and {cls.__module__})")
        _REGISTRY[name] = cls
        cls.component_name = name
        return cls

    return deco


def _import_folder(folder: Path, package: str) -> None:
    for info in pkgutil.iter_modules([str(folder)]):
        if info.name.startswith("_"):
            continue
        modname = f"{package}.{info.name}"
        if modname in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(modname, folder / f"{info.name}.py")
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules[modname] = module
        spec.loader.exec_module(module)


def load_all() -> None:
    """Import every component module once (shipped ones and those on $INFERFLOW_COMPONENT_PATH)."""
    global _loaded
    if _loaded:
        return
    pkg = importlib.import_module("inferflow.components")
    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"inferflow.components.{info.name}")
    for i, extra in enumerate(p for p in os.environ.get("INFERFLOW_COMPONENT_PATH", "").split(os.pathsep) if p):
        _import_folder(Path(extra), f"inferflow_user_components_{i}")
    _loaded = True


def names() -> list[str]:
    load_all()
    return sorted(_REGISTRY)


def get(name: str, *, where: tuple[str | None, str | None] = (None, None)) -> type:
    load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise SpecError(*where, f"unknown component {name!r} (known: {', '.join(sorted(_REGISTRY))})") from None


def _coerce(value: Any, typ: Any, field: str, comp: str, where) -> Any:
    origin = typing.get_origin(typ)
    if typ is Any or value is None:
        return value
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        # ``X | None`` checks as X (None was handled above); wider unions are the component's business
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        return _coerce(value, args[0], field, comp, where) if len(args) == 1 else value
    ok = {int: (int,), float: (int, float), bool: (bool,), str: (str,), dict: (dict,), list: (list, tuple)}.get(typ)
    if ok is None:
        return value
    if isinstance(value, bool) and typ in (int, float):
        ok = ()
    if typ is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, ok):
        raise SpecError(where[0], f"{where[1]}.params.{field}" if where[1] else field,
                        f"component {comp!r} expects {typ.__name__} for '{field}', got {type(value).__name__} {value!r}")
    return float(value) if typ is float else value


def make_params(cls: type, params: dict[str, Any], *, where: tuple[str | None, str | None] = (None, None)) -> Any:
    """Build ``cls.Params`` from a dict, naming unknown, missing and mistyped fields."""
    pcls = cls.Params
    fields = {f.name: f for f in dataclasses.fields(pcls)}
    hints = typing.get_type_hints(pcls)
    unknown = sorted(set(params) - set(fields))
    comp = getattr(cls, "component_name", cls.__name__)
    if unknown:
        raise SpecError(where[0], f"{where[1]}.params.{unknown[0]}" if where[1] else unknown[0],
                        f"component {comp!r} has no parameter {unknown[0]!r} (it takes: {', '.join(fields)})")
    missing = [n for n, f in fields.items() if n not in params and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise SpecError(where[0], f"{where[1]}.params" if where[1] else "params",
                        f"component {comp!r} needs parameter {missing[0]!r}")
    return pcls(**{k: _coerce(v, hints.get(k, Any), k, comp, where) for k, v in params.items()})


def create(name: str, params: dict[str, Any] | None = None, *, where: tuple[str | None, str | None] = (None, None)):
    """Instantiate a registered component from a parameter dict."""
    cls = get(name, where=where)
    p = make_params(cls, params or {}, where=where)
    try:
        return cls(p)
    except SpecError as e:
        if e.file is not None or where == (None, None):
            raise
        # a component (or a sub-component it creates) refused a value: point at this spec step
        own = e.key in {f.name for f in dataclasses.fields(cls.Params)}
        key = f"{where[1]}.params" + (f".{e.key}" if own else "") if where[1] else e.key
        raise SpecError(where[0], key, f"component {name!r}: " + (e.problem if own or not e.key
                                                                    else f"{e.key}: {e.problem}")) from None
    except (ValueError, TypeError, KeyError, IndexError, ZeroDivisionError, AssertionError) as e:
        if where == (None, None):
            raise
        raise SpecError(where[0], f"{where[1]}.params" if where[1] else "params",
                        f"component {name!r} rejected its parameters: {type(e).__name__}: {e}") from None
