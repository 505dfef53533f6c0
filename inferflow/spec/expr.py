"""A small, safe expression language for spec values.

Specs compute hyper-parameters such as ``hidden_size // num_attention_heads``. Expressions are
parsed with :mod:`ast` and evaluated by walking an allow-listed subset of nodes: nothing is ever
passed to ``eval``, so a spec file cannot run code.
"""
from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any, Mapping

from ..errors import SpecError

_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_CMPOPS = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
    ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_, ast.IsNot: operator.is_not,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}


def _get(container: Any, key: Any, default: Any = None) -> Any:
    if isinstance(container, Mapping):
        return container.get(key, default)
    if isinstance(container, (list, tuple)) and isinstance(key, int) and -len(container) <= key < len(container):
        return container[key]
    return default


FUNCTIONS = {
    "min": min, "max": max, "int": int, "float": float, "bool": bool, "str": str, "abs": abs,
    "round": round, "len": len, "sqrt": math.sqrt, "log2": math.log2, "get": _get,
}
_MAX_POW = 4096
_MAX_INT_BITS = 1 << 16     # bounds every integer result: chained params must not build huge numbers
_MAX_LEN = 1 << 16          # bounds string/list results for the same reason
_MAX_EXPR_CHARS = 4096      # deeper nesting than this is never a hyper-parameter formula
_EXPR_RE = re.compile(r"^\$(?:\{(?P<expr>.*)\}|(?P<name>[A-Za-z_][A-Za-z0-9_]*))$", re.S)


def is_expression(value: Any) -> bool:
    """True for the spec forms ``$name`` and ``${expression}``."""
    return isinstance(value, str) and _EXPR_RE.match(value.strip()) is not None


def expression_text(value: str) -> str:
    m = _EXPR_RE.match(value.strip())
    return m.group("expr") if m.group("expr") is not None else m.group("name")


def evaluate(text: str, names: Mapping[str, Any], *, where: tuple[str | None, str | None] = (None, None)) -> Any:
    """Evaluate ``text`` with ``names`` bound; raise SpecError naming ``where`` on any problem."""
    file, key = where
    shown = repr(text) if len(text) <= 200 else repr(text[:200] + "...")
    if len(text) > _MAX_EXPR_CHARS:
        raise SpecError(file, key, f"expression {shown} is longer than {_MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise SpecError(file, key, f"invalid expression {shown}: {e.msg}") from None
    except (RecursionError, MemoryError):
        raise SpecError(file, key, f"expression {shown} is nested too deeply") from None
    try:
        return _eval(tree.body, names)
    except SpecError as e:
        raise SpecError(file, key, f"in expression {shown}: {e.problem}") from None
    except (RecursionError, MemoryError):
        raise SpecError(file, key, f"expression {shown} is nested too deeply") from None
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, KeyError, IndexError) as e:
        raise SpecError(file, key, f"in expression {shown}: {type(e).__name__}: {e}") from None


def resolve(value: Any, names: Mapping[str, Any], *, where: tuple[str | None, str | None] = (None, None)) -> Any:
    """Resolve a spec value: ``$name``/``${expr}`` strings are evaluated, containers recursively, the rest is literal."""
    if isinstance(value, str) and is_expression(value):
        return evaluate(expression_text(value), names, where=where)
    if isinstance(value, list):
        return [resolve(v, names, where=_sub(where, f"[{n}]")) for n, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: resolve(v, names, where=_sub(where, f".{k}")) for k, v in value.items()}
    return value


def _sub(where: tuple[str | None, str | None], suffix: str) -> tuple[str | None, str | None]:
    """Extend an error location by one key, so messages point at the offending entry."""
    return where if where[1] is None else (where[0], where[1] + suffix)


def _eval(node: ast.AST, names: Mapping[str, Any]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in names:
            return names[node.id]
        if node.id in ("None", "True", "False"):
            return {"None": None, "True": True, "False": False}[node.id]
        raise SpecError(None, None, f"unknown name {node.id!r} (known: {', '.join(sorted(names)) or 'none'})")
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left, names), _eval(node.right, names)
        if isinstance(node.op, ast.Pow) and isinstance(right, (int, float)) and abs(right) > _MAX_POW:
            raise SpecError(None, None, f"exponent {right} too large")
        if isinstance(node.op, ast.Mult) and (isinstance(left, (str, list)) or isinstance(right, (str, list))):
            raise SpecError(None, None, "sequence repetition is not allowed")
        _check_cost(node.op, left, right)
        return _check_size(_BINOPS[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, names))
    if isinstance(node, ast.BoolOp):
        if isinstance(node.op, ast.And):
            result = True
            for v in node.values:
                result = _eval(v, names)
                if not result:
                    return result
            return result
        result = False
        for v in node.values:
            result = _eval(v, names)
            if result:
                return result
        return result
    if isinstance(node, ast.Compare):
        left = _eval(node.left, names)
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, names)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return _eval(node.body, names) if _eval(node.test, names) else _eval(node.orelse, names)
    if isinstance(node, ast.Call):
        fn = node.func.id if isinstance(node.func, ast.Name) else None
        if fn not in FUNCTIONS:
            what = f"function {fn!r}" if fn else "calling this kind of expression"
            raise SpecError(None, None, f"{what} is not allowed (allowed functions: {', '.join(FUNCTIONS)})")
        if node.keywords:
            raise SpecError(None, None, f"keyword arguments are not allowed (in the call to {fn})")
        return _check_size(FUNCTIONS[fn](*[_eval(a, names) for a in node.args]))
    if isinstance(node, ast.Subscript):
        container, key = _eval(node.value, names), _eval(node.slice, names)
        return container[key]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [_eval(e, names) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_eval(k, names): _eval(v, names) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Attribute):
        raise SpecError(None, None, f"attribute access ('.{node.attr}') is not allowed")
    raise SpecError(None, None, f"unsupported syntax {type(node).__name__}")


def _int_bits(v: Any) -> int:
    return abs(v).bit_length() if isinstance(v, int) and not isinstance(v, bool) else 0


def _check_cost(op: ast.operator, left: Any, right: Any) -> None:
    """Refuse integer products/powers whose result would exceed the size bound before computing them."""
    if isinstance(op, ast.Mult) and _int_bits(left) + _int_bits(right) > _MAX_INT_BITS:
        raise SpecError(None, None, f"integer result larger than {_MAX_INT_BITS} bits")
    if (isinstance(op, ast.Pow) and _int_bits(left) > 1 and isinstance(right, int) and right > 0
            and _int_bits(left) * right > _MAX_INT_BITS):
        raise SpecError(None, None, f"integer result larger than {_MAX_INT_BITS} bits")


def _check_size(v: Any) -> Any:
    if _int_bits(v) > _MAX_INT_BITS:
        raise SpecError(None, None, f"integer result larger than {_MAX_INT_BITS} bits")
    if isinstance(v, (str, list, dict)) and len(v) > _MAX_LEN:
        raise SpecError(None, None, f"result longer than {_MAX_LEN} items")
    return v
