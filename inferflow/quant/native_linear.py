"""Linears over ggml blocks through the native kernel ``inferflow/native/gemv_ggml.c`` (ctypes).

The kernel reads the GGUF blocks as stored and decodes them in registers with the reference's arithmetic, so
every weight is bit-identical to :func:`inferflow.quant.ggml.dequantize` and the product is exact up to float32
summation order, which is fixed per output element (independent of the row count and of the thread count).
A decode step runs ~200 of these calls: argument types are set once and each call does only the ctypes call,
one output allocation and, off float32, two casts.
"""
from __future__ import annotations

import ctypes
import threading

import torch

from .. import native
from . import ggml

# ggml types the kernel decodes (gemv_ggml.c)
SUPPORTED = frozenset({ggml.Q4_0, ggml.Q4_1, ggml.Q5_0, ggml.Q5_1, ggml.Q8_0, ggml.Q4_K, ggml.Q6_K})
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_loaded: list = []  # [lib or None] once tried
_lock = threading.Lock()
_simd = 1  # 0: the portable C loop even where AVX-512 is compiled in (tests exercise it on any machine)


def _lib() -> ctypes.CDLL | None:
    if _loaded:
        return _loaded[0]
    with _lock:
        if not _loaded:
            lib = native.load("gemv_ggml")
            if lib is not None:
                lib.ggml_gemv.argtypes = [_I, _P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I, _I]
                lib.ggml_gemv.restype = _I
                lib.ggml_dequant.argtypes = [_I, _P, _I64, _P, _I64, _I64, _I, _I]
                lib.ggml_dequant.restype = _I
                lib.ggml_has_simd.restype = _I
                lib.ggml_dequant_bf16.argtypes = [_I, _P, _I64, _P, _I64, _I64, _I]
                lib.ggml_dequant_bf16.restype = _I
                lib.ggml_set_grain.argtypes = [_I64]
                lib.ggml_set_grain.restype = None
                lib.ggml_has_vnni.restype = _I
                lib.ggml_gemv_q8x.argtypes = [_I, _P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I, _P]
                lib.ggml_gemv_q8x.restype = _I
            _loaded.append(lib)
    return _loaded[0]


def available(qtype: int | None = None) -> bool:
    """True when native kernels are on ($INFERFLOW_NATIVE), the library builds here and ``qtype`` (if given) is
    one it decodes."""
    if not native.enabled() or (qtype is not None and qtype not in SUPPORTED):
        return False
    return _lib() is not None


def has_simd() -> bool:
    """Whether the build has the AVX-512 kernels (else only the portable loop)."""
    lib = _lib()
    return bool(lib is not None and lib.ggml_has_simd())


def set_simd(on: bool) -> None:
    """Use the AVX-512 kernels (default) or the portable C loop (tests)."""
    global _simd
    _simd = 1 if on else 0


def set_grain(weights: int) -> None:
    """Weights per extra thread below which a GEMV stays on one thread (gemv_ggml.c; default 2^19)."""
    _lib().ggml_set_grain(int(weights))


def _rows(blocks: torch.Tensor) -> int:
    if blocks.dim() != 2 or blocks.stride(1) != 1 or blocks.dtype != torch.uint8 or blocks.device.type != "cpu":
        raise ValueError("native ggml kernels need CPU uint8 [N, row_bytes] blocks with contiguous rows")
    return blocks.stride(0)


def _operands(shape: tuple[int, int], x: torch.Tensor, bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x as contiguous float32 rows, the float32 output [M, N], the bias as contiguous float32."""
    n, k = shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"native ggml GEMV: x must be [M, {k}], got {list(x.shape)}")
    if x.dtype != torch.float32 or x.stride(-1) != 1:
        x = x.float().contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    return x, torch.empty(x.shape[0], n, dtype=torch.float32), bias


def gemv(blocks: torch.Tensor, qtype: int, shape: tuple[int, int], x: torch.Tensor,
         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for float32 ``x`` [M, K] (any leading dims flattened by the caller) and ``W`` the
    ggml blocks [N, row_bytes]: float32 [M, N]."""
    n, k = shape
    x, y, bias = _operands(shape, x, bias)
    m = x.shape[0]
    if m == 0:
        return y
    rc = _lib().ggml_gemv(qtype, blocks.data_ptr(), _rows(blocks), x.data_ptr(), x.stride(0), y.data_ptr(), n,
                          None if bias is None else bias.data_ptr(), m, n, k, native.threads(), _simd)
    if rc:
        raise ValueError(f"native ggml kernel refused {ggml.type_name(qtype)} {list(shape)}")
    return y


# Types the llama.cpp-style kernel takes (x quantized to int8 per 32-block; approximate: see gemv_ggml.c)
Q8X_TYPES = frozenset({ggml.Q4_0, ggml.Q4_1, ggml.Q8_0})


def has_vnni() -> bool:
    """Whether the build has the int8-activation (AVX512-VNNI) kernel, :func:`gemv_q8x`."""
    lib = _lib()
    return bool(lib is not None and lib.ggml_has_vnni())


def gemv_q8x(blocks: torch.Tensor, qtype: int, shape: tuple[int, int], x: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """As :func:`gemv`, with ``x`` quantized to int8 per 32-block first and integer dot products (llama.cpp's
    arithmetic: within ~1e-2 relative of the exact product, not exact). Q4_0 / Q4_1 / Q8_0 with VNNI only."""
    n, k = shape
    x, y, bias = _operands(shape, x, bias)
    m = x.shape[0]
    if m == 0:
        return y
    scratch = torch.empty(m * k + 8 * m * (k // 32), dtype=torch.uint8)
    rc = _lib().ggml_gemv_q8x(qtype, blocks.data_ptr(), _rows(blocks), x.data_ptr(), x.stride(0), y.data_ptr(), n,
                              None if bias is None else bias.data_ptr(), m, n, k, native.threads(),
                              scratch.data_ptr())
    if rc:
        raise ValueError(f"native int8-activation kernel refused {ggml.type_name(qtype)} {list(shape)}")
    return y


def dequantize(blocks: torch.Tensor, qtype: int, shape: tuple[int, int], out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """The weight decoded to float32 [N, K] (bit-identical to ggml.dequantize), into ``out`` when given."""
    n, k = shape
    if out is None:
        out = torch.empty(n, k, dtype=torch.float32)
    assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() == n * k
    if _lib().ggml_dequant(qtype, blocks.data_ptr(), _rows(blocks), out.data_ptr(), n, k, native.threads(), _simd):
        raise ValueError(f"native ggml kernel refused {ggml.type_name(qtype)} {list(shape)}")
    return out.view(n, k)


def dequantize_bf16(blocks: torch.Tensor, qtype: int, shape: tuple[int, int], out: torch.Tensor) -> torch.Tensor:
    """The weight decoded (as :func:`dequantize`) and rounded to bf16 into ``out`` (numel N * K): the operand of
    the large-batch bf16 GEMM. Without AVX512-BF16 in the build, decoded to float32 first and cast."""
    n, k = shape
    assert out.dtype == torch.bfloat16 and out.is_contiguous() and out.numel() == n * k
    if _lib().ggml_dequant_bf16(qtype, blocks.data_ptr(), _rows(blocks), out.data_ptr(), n, k, native.threads()):
        out.view(n, k).copy_(dequantize(blocks, qtype, shape))
    return out.view(n, k)
