"""Programs of native ops run as one call per decode step (``step.c``): the binding.

A :class:`Program` is a list of ops (``step_op`` names in step.c) with their arguments: pointers to preallocated
buffers and weights, sizes and flags, laid out as step.c's structs. :meth:`Program.run` runs them all inside one
OpenMP parallel region for the rows of a :class:`StepState` (positions, KV slots, key counts, block tables of this
step). The lowering of a model into a program is :mod:`inferflow.model.native_decode`.
"""
from __future__ import annotations

import ctypes
from typing import Any

import torch

from . import load

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class StepState(ctypes.Structure):
    """The per-step values every op reads: rows, and per row its token id, position, new K/V slot, key count (the
    new key included) and block table (int64 pointers)."""

    _fields_ = [("M", _I), ("ids", _P), ("pos", _P), ("slots", _P), ("lens", _P), ("tables", _P), ("tstride", _I),
                ("err", _I)]


class _StepOp(ctypes.Structure):
    _fields_ = [("fn", _P), ("args", _P)]


_NORM = [("a", _P), ("b", _P), ("w", _P), ("s", _P), ("y", _P), ("sx", _I), ("D", _I), ("dt", _I), ("wdt", _I),
         ("wif", _I), ("lanes", _I), ("eps", _D), ("offset", _D)]
# each op's argument struct, field for field step.c's
_FIELDS: dict[str, list[tuple[str, Any]]] = {
    "embed": [("w", _P), ("y", _P), ("qt", _I), ("rb", _I), ("D", _I), ("dt", _I)],
    "gemv_f": [("x", _P), ("w", _P), ("bias", _P), ("y", _P), ("ldx", _I), ("N", _I), ("K", _I), ("t", _I)],
    "gemv_q": [("w", _P), ("x", _P), ("bias", _P), ("y", _P), ("qt", _I), ("rb", _I), ("ldx", _I), ("ldy", _I),
               ("N", _I), ("K", _I)],
    "quant_x": [("x", _P), ("scratch", _P), ("ldx", _I), ("K", _I)],
    "gemv_q8x": [("w", _P), ("bias", _P), ("scratch", _P), ("y", _P), ("qt", _I), ("rb", _I), ("ldy", _I),
                 ("N", _I), ("K", _I)],
    "rmsnorm": _NORM,
    "add_rmsnorm": _NORM,
    "head_rmsnorm": [("x", _P), ("w", _P), ("y", _P), ("sx", _I), ("sy", _I), ("per", _I), ("D", _I), ("dt", _I),
                     ("wdt", _I), ("wif", _I), ("lanes", _I), ("eps", _D), ("offset", _D)],
    "add": [("a", _P), ("b", _P), ("y", _P), ("D", _I), ("dt", _I)],
    "silu_mul": [("g", _P), ("u", _P), ("out", _P), ("sg", _I), ("su", _I), ("I", _I), ("dt", _I)],
    "rope": [("x", _P), ("cos", _P), ("sin", _P), ("out", _P), ("sxn", _I), ("sxh", _I), ("H", _I), ("D", _I),
             ("dt", _I)],
    "attention": [("q", _P), ("knew", _P), ("vnew", _P), ("kc", _P), ("vc", _P), ("out", _P), ("part", _P),
                  ("ks", _P), ("vs", _P), ("sq", _I),
                  ("skn", _I), ("svn", _I), ("H", _I), ("Hkv", _I), ("D", _I), ("bs", _I), ("dt", _I),
                  ("cdt", _I), ("win", _I), ("scale", _D)],
}
_FIELDS["kv_write"] = _FIELDS["attn_merge"] = _FIELDS["attention"]  # the same struct: one fills all three ops
_STRUCTS = {name: type(f"Op_{name}", (ctypes.Structure,), {"_fields_": f}) for name, f in _FIELDS.items()}
_state: dict[str, Any] = {}


def _lib() -> ctypes.CDLL | None:
    if "lib" not in _state:
        lib = load("step")
        if lib is not None:
            lib.step_run.argtypes = [_P, _I, ctypes.POINTER(StepState), ctypes.c_int, _P]
            lib.step_run.restype = ctypes.c_int
            lib.step_op.argtypes = [ctypes.c_char_p]
            lib.step_op.restype = _P
        _state["lib"] = lib
    return _state["lib"]


def available() -> bool:
    """Whether the step executor builds here (and native kernels are on)."""
    return _lib() is not None


def has_op(name: str) -> bool:
    """Whether this build has op ``name`` (``quant_x`` / ``gemv_q8x`` need AVX512-VNNI)."""
    lib = _lib()
    return lib is not None and bool(lib.step_op(name.encode()))


def ptr(v: Any) -> Any:
    """A tensor's data pointer (None stays NULL); other values as given."""
    return v.data_ptr() if isinstance(v, torch.Tensor) else v


class Program:
    """Ops appended in execution order; :meth:`run` executes them all for one step's rows."""

    def __init__(self) -> None:
        lib = _lib()
        if lib is None:
            raise RuntimeError("native step executor unavailable")
        self._lib = lib
        self.args: list[ctypes.Structure] = []
        self.names: list[str] = []  # each op's name and what it computes (profiles)
        self._fns: list[int] = []
        self._table: ctypes.Array | None = None

    def add(self, op: str, label: str = "", **fields: Any) -> ctypes.Structure:
        """Append op ``op`` (``label``: what it computes, for profiles); tensors given as fields are passed by data pointer (the caller keeps them alive).
        Returns the argument struct (its fields may be changed later, e.g. a table that grew)."""
        fn = self._lib.step_op(op.encode())
        if not fn:
            raise ValueError(f"native step op {op!r} is not in this build")
        args = _STRUCTS[op](**{k: ptr(v) for k, v in fields.items()})
        self.args.append(args)
        self.names.append(f"{op} {label}".strip())
        self._fns.append(fn)
        self._table = None
        return args

    def __len__(self) -> int:
        return len(self.args)

    def run(self, state: StepState, threads: int, times: torch.Tensor | None = None) -> None:
        """All ops for ``state``'s rows on ``threads`` threads; ``times`` (float64 [len(self)]): each op's seconds
        (until every thread finished it) are added to it (profiling)."""
        if self._table is None:
            self._table = (_StepOp * len(self.args))(*[_StepOp(f, ctypes.addressof(a))
                                                       for f, a in zip(self._fns, self.args)])
        if times is not None and (times.dtype != torch.float64 or times.numel() < len(self.args)):
            raise ValueError(f"times: float64 [{len(self.args)}] expected")
        if self._lib.step_run(self._table, len(self.args), ctypes.byref(state), threads,
                              None if times is None else times.data_ptr()):
            raise MemoryError("native decode step: an op could not allocate its scratch memory")
