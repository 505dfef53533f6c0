"""The only globals a model pickle may name, and what each one means to our interpreter.

Nothing here is imported from the name in the file: a name maps to a plain value (a torch dtype, a
storage dtype marker) or to a :class:`Func` whose handler is our own code.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64, "ComplexDoubleStorage": torch.complex128, "UntypedStorage": torch.uint8,
}
DTYPE_NAMES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64, "int64": torch.int64,
    "long": torch.int64, "int32": torch.int32, "int": torch.int32, "int16": torch.int16, "short": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool, "uint16": torch.uint16, "uint32": torch.uint32,
    "uint64": torch.uint64, "complex64": torch.complex64, "complex128": torch.complex128,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
}


class StorageType:
    """The value of an allow-listed ``torch.XStorage`` global: only its dtype matters."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype


class Func:
    """An allow-listed callable global; calling it runs our handler, never the named object."""

    __slots__ = ("name", "handler")

    def __init__(self, name: str, handler: Callable[..., Any]):
        self.name, self.handler = name, handler


def _ordered_dict(*args: Any) -> dict:
    if len(args) > 1:
        raise TypeError("OrderedDict takes at most one argument")
    return dict(args[0]) if args else {}


def _codecs_encode(text: Any, encoding: str = "utf-8") -> bytes:
    # protocol 2 pickles bytes as _codecs.encode(str, 'latin1'); nothing else is accepted
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise TypeError("only _codecs.encode(str, 'latin1') is supported")
    return text.encode("latin-1")


def _plain(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        if not all(isinstance(a, (int, float, str, bytes, tuple, list, set, frozenset, type(None))) for a in args):
            raise TypeError("plain-value arguments expected")
        return fn(*args)
    return call


def allowed_globals(tensor_hooks: dict[str, Callable[..., Any]]) -> dict[str, Any]:
    """The full allow-list: ``module.name`` -> value; ``tensor_hooks`` supplies the torch._utils rebuilders."""
    table: dict[str, Any] = {"collections.OrderedDict": Func("collections.OrderedDict", _ordered_dict),
                             "_codecs.encode": Func("_codecs.encode", _codecs_encode),
                             "torch.Size": Func("torch.Size", _plain(lambda t=(): tuple(t)))}
    for mod in ("builtins", "__builtin__"):
        table[f"{mod}.set"] = Func("builtins.set", _plain(lambda it=(): set(it)))
        table[f"{mod}.frozenset"] = Func("builtins.frozenset", _plain(lambda it=(): frozenset(it)))
        table[f"{mod}.slice"] = Func("builtins.slice", _plain(slice))
    for name, dtype in STORAGE_DTYPES.items():
        for mod in ("torch", "torch.storage", "torch.cuda"):
            table[f"{mod}.{name}"] = StorageType(f"{mod}.{name}", dtype)
    for name, dtype in DTYPE_NAMES.items():
        table[f"torch.{name}"] = dtype
    for name, fn in tensor_hooks.items():
        table[f"torch._utils.{name}"] = Func(f"torch._utils.{name}", fn)
    return table


def describe(value: Any) -> str:
    """A short, safe description of a value for error messages (never a repr of hostile data)."""
    if isinstance(value, (Func, StorageType)):
        return value.name
    if isinstance(value, torch.dtype):
        return str(value)
    return type(value).__name__
