"""Float linears of a few rows (decode steps) on the CPU through ``gemv_float.c``.

The kernel streams each weight once for all rows (see the C file): torch's GEMM for 2-16 rows and its 16-bit GEMVs
are slower (tools/bench_native_gemv.py: ~1.3-2x at 8 rows; bfloat16 on AMX tiles), its float32 GEMV is about as
fast. Results are deterministic and independent of the row count and of the thread count, so batched and
single-sequence decoding give the same tokens (torch's are not: its kernels change with the row count).

:func:`linear` returns None where the kernel does not apply (other dtypes or devices, too many rows, a weight that
is not contiguous, native kernels off): the caller keeps its torch path.
"""
from __future__ import annotations

import ctypes

import torch

from . import load

_c_i64, _c_int, _c_p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_fns: dict[torch.dtype, object] | None = None
MAX_ROWS = 16


def _bind() -> dict[torch.dtype, object]:
    global _fns
    if _fns is None:
        lib = load("gemv_float")
        fns: dict[torch.dtype, object] = {}
        if lib is not None:
            for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16"), (torch.float16, "f16")):
                fn = getattr(lib, f"inferflow_gemv_{name}")
                # (x, ldx, w, bias, y, M, N, K, threads)
                fn.argtypes = [_c_p, _c_i64, _c_p, _c_p, _c_p, _c_i64, _c_i64, _c_i64, _c_int]
                fn.restype = _c_int
                fns[dtype] = fn
        _fns = fns
    return _fns


def available() -> bool:
    """True where the native float kernels are built and enabled."""
    return bool(_bind())


def amx(on: bool | None = None) -> bool:
    """Whether bfloat16 runs on AMX tiles (where the CPU and OS allow them); ``on`` switches it (tests, benchmarks:
    AMX and the AVX512_BF16 path round differently, each is row- and thread-count independent)."""
    lib = load("gemv_float") if _bind() else None
    if lib is None:
        return False
    return bool(lib.inferflow_gemv_amx(-1 if on is None else int(on)))


def reset() -> None:
    """Forget the bound library (tests toggling ``INFERFLOW_NATIVE``)."""
    global _fns
    _fns = None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for a 2-D CPU ``x`` of 1..MAX_ROWS rows whose dtype is the weight's (float32,
    bfloat16 or float16); None where that does not hold."""
    fn = (_fns if _fns is not None else _bind()).get(x.dtype)
    if fn is None or weight.dtype != x.dtype or x.dim() != 2 or weight.dim() != 2 or not x.is_cpu \
            or not weight.is_cpu:
        return None
    m, k = x.shape
    n, kw = weight.shape
    if not 1 <= m <= MAX_ROWS or kw != k or k == 0 or x.stride(1) != 1 or not weight.is_contiguous() \
            or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous() or bias.shape != (n,)):
        return None
    y = torch.empty((m, n), dtype=x.dtype)
    ld = x.stride(0) if m > 1 else k
    if fn(x.data_ptr(), ld, weight.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), m, n, k,
          torch.get_num_threads()) != 0:
        return None
    return y
