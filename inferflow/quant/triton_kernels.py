"""GPU matmuls that read block-quantized weights directly: Triton kernels that load the packed bytes and the block
scales of each weight tile, dequantize it in registers and multiply, so a decode step reads 4.5-8.5 bits per weight
from memory instead of 16. Used by :mod:`inferflow.quant.cpu_kernels` for weights held on a CUDA device (the
default "fast" kernel set) when ``triton`` imports; a CPU never comes here. Tests run the same kernels on a CPU under
``TRITON_INTERPRET=1`` (tests/test_triton_quant.py); tools/bench_triton_quant.py checks and times them on a GPU.

Layouts (one block = 32 weights; a weight row is whole blocks, rows ``row_bytes`` apart):

    kind   block bytes  decode                                         formats
    q4c    18           s * (q - zc / 16), s = SCALES[c]; byte 0 c,    inferflow q4 (quant/affine.py)
                        byte 1 zc, bytes 2..17 nibbles (code j: byte 2 + j % 16, bits 4 * (j // 16))
    q8_0   34           d * q; bytes 0..1 fp16 d, bytes 2..33 int8 q   ggml Q8_0 = inferflow q8 and q8_0
    q4_0   18           d * (q - 8); bytes 0..1 fp16 d, nibbles as q4c ggml Q4_0 = inferflow q4_0

Each weight is decoded with the same float32 operations as the torch decoders (quant/affine.py, quant/ggml.py), so
the kernels multiply by bit-identical weights; only the summation order differs (float tolerance).

Two kernels: a GEMV-style one for few activation rows (decode: each program owns BLOCK_N output columns of one row
and reduces over K), and a tiled ``tl.dot`` GEMM for many rows (prefill). float32 activations use IEEE float32
dots (no TF32), bf16/fp16 activations multiply the decoded tile in their own dtype with float32 accumulation
(under the interpreter, whose bf16 ``tl.dot`` computes garbage in triton 3.9, the GEMM dots in float32 instead).
"""
from __future__ import annotations

import functools
import os

import torch

from . import ggml

KINDS = ("q4c", "q8_0", "q4_0")
_CODE = {"q4c": 0, "q8_0": 1, "q4_0": 2}
_BLOCK_BYTES = {"q4c": 18, "q8_0": 34, "q4_0": 18}
GEMV_MAX_ROWS = 16  # activation rows up to which the GEMV kernel runs (above: the tl.dot GEMM)
GEMV_TILE = (16, 256)      # (BLOCK_N, BLOCK_K): output columns per program, K per step (8 blocks)
GEMM_TILE = (32, 64, 64)   # (BLOCK_M, BLOCK_N, BLOCK_K); tl.dot needs >= 16 each
# Repack each weight once into int32 code words + 16-bit block scales (quant/triton_soa.py): coalesced loads and
# one weight read per call for all rows; INFERFLOW_TRITON_SOA=0 keeps the kernels below reading the blocks
SOA = os.environ.get("INFERFLOW_TRITON_SOA", "1") != "0"
_KIND_OF: dict[int, str] = {ggml.Q8_0: "q8_0", ggml.Q4_0: "q4_0"}  # qtype -> kind; formats.py adds q4


def register(qtype: int, kind: str) -> None:
    """Let blocks of ``qtype`` run through the kernels as layout ``kind`` (one of :data:`KINDS`)."""
    assert kind in KINDS
    _KIND_OF[qtype] = kind


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """True when triton imports (the kernels are compiled lazily, at first use)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401 - the part the kernels use
    except Exception:  # noqa: BLE001 - any import failure means: no Triton path
        return False
    return True


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


ENV = "INFERFLOW_TRITON_QUANT"  # "0": never use these kernels (the reference decode runs instead)
_broken: list[str] = []          # set when a kernel failed to compile or run: the process stops using them


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() not in ("0", "false", "no", "off") and not _broken


def supports(qtype: int, shape: tuple[int, ...], device: torch.device | str) -> bool:
    """A 2-D weight of this type whose rows are whole blocks, on a CUDA device (or any device when the Triton
    interpreter runs), with triton importable and the kernels not disabled ($INFERFLOW_TRITON_QUANT=0)."""
    dev = torch.device(device)
    return qtype in _KIND_OF and len(shape) == 2 and shape[1] % 32 == 0 and \
        (dev.type == "cuda" or (interpreted() and dev.type == "cpu")) and enabled() and available()


def disable(why: str) -> None:
    """Stop using the kernels in this process (a compile or launch failure): callers fall back to the reference."""
    import warnings

    if not _broken:
        warnings.warn(f"inferflow Triton quantized matmul disabled: {why}", RuntimeWarning, stacklevel=2)
    _broken.append(why)


def _kernels():
    from . import triton_ops  # imports triton (and picks up TRITON_INTERPRET) at first use

    return triton_ops.triton, triton_ops.gemv, triton_ops.gemm


_TABLES: dict[torch.device, torch.Tensor] = {}


def _scale_table(device: torch.device) -> torch.Tensor:
    """inferflow q4's 256 log-scale values (quant/affine.py's header table) on ``device``."""
    if device not in _TABLES:
        from .affine import SCALE_BIAS, SCALE_STEPS
        from .bitplanes import log_scales

        _TABLES[device] = log_scales(256, SCALE_BIAS, SCALE_STEPS).to(device)
    return _TABLES[device]


def matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, shape: tuple[int, int],
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for W [N, K] held as ``blocks`` (uint8 [N, row_bytes]) of ``qtype``; returns
    x's dtype."""
    triton, gemv, gemm = _kernels()
    kind = _KIND_OF[qtype]
    n, k = shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if SOA:  # the repacked layout and its kernels (quant/triton_soa.py); SOA = False: the block-reading kernels
        from . import triton_soa

        y = triton_soa.matmul(x2, blocks, kind, shape, _scale_table(x.device), bias, interpreted())
        return y.reshape(*x.shape[:-1], n)
    w = blocks.reshape(n, -1)
    if not w.is_contiguous():
        w = w.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tab = _scale_table(x.device)
    b = bias if bias is not None else y  # any pointer: unused without HAS_BIAS
    common = dict(HAS_BIAS=bias is not None, KIND=_CODE[kind], BB=_BLOCK_BYTES[kind])
    if m <= GEMV_MAX_ROWS:
        # small column tiles: a 4096-wide output still spreads over 256 programs (a GPU has ~130 SMs)
        bn, bk = GEMV_TILE
        grid = (triton.cdiv(n, bn), m)
        gemv[grid](x2, w, tab, b, y, n, k, w.stride(0), x2.stride(0), y.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                   **common)
    else:
        bm, bn, bk = GEMM_TILE
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        gemm[grid](x2, w, tab, b, y, m, n, k, w.stride(0), x2.stride(0), y.stride(0),
                   IEEE=x.dtype == torch.float32 or interpreted(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **common)
    return y.reshape(*x.shape[:-1], n)
