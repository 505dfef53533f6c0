"""Triton kernels over the structure-of-arrays repacking of :mod:`inferflow.quant.triton_kernels` (layouts there).

A module of its own because ``@triton.jit`` functions must be module globals and triton is imported only when a
quantized weight first runs on this path (the interpreter switch, TRITON_INTERPRET=1, is read at that import).

- ``gemv_fma``: 1-2 activation rows (decode). A program owns BLOCK_N output columns for every row, so the weight is
  read once per call; it loads whole int32 code words (q4) / int8 codes (q8) contiguous along K, decodes them in
  registers with the torch decoders' float32 operations and accumulates float32 products (per block each step, or
  elementwise and reduced after the K loop), optionally loading the next tile before decoding this one.
- ``gemv_dot``: 3-16 rows. Same tiling; the decoded tile is multiplied with ``tl.dot`` (rows padded to 16).
- ``dequant``: the decoded weight written whole (prefill: then a cuBLAS matmul, near bf16 speed for many rows).

Autotuned per (N, K, rows bucket, layout) on a GPU (INFERFLOW_TRITON_AUTOTUNE=0: one fixed config); the
interpreter runs one small config (autotune there is slow). tools/compile_triton_quant.py compiles every config
for sm_90 without a GPU.
"""
import os

import triton
import triton.language as tl

from .triton_q4 import autotune

_INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_ONE_CONFIG = os.environ.get("INFERFLOW_TRITON_AUTOTUNE", "1") == "0"


@triton.jit
def _add(a, b):
    # tl.sum's combine function may have been decorated before TRITON_INTERPRET was set (see triton_ops.add)
    return a + b


@triton.jit
def _load3(q_ptr, s_ptr, rn, k0, N, K, KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The raw codes ([BLOCK_N, BLOCK_K / 32, 32] int8 or [.., 4] int32 words) and 16-bit scales
    ([BLOCK_N, BLOCK_K / 32, 1]) of rows rn, columns k0..; zeros outside the weight."""
    rows = rn[:, None, None].to(tl.int64)
    rb = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    bmask = (rn < N)[:, None, None] & (rb < K // 32)[None, :, None]  # [BN, G, 1]
    if KIND == 1:  # q8_0: int8 codes [N, K]
        rk = (rb * 32)[None, :, None] + tl.arange(0, 32)[None, None, :]
        raw = tl.load(q_ptr + rows * K + rk, mask=bmask, other=0)
    else:  # 4-bit: int32 words [N, K / 8]; a block is 4 words
        rw = (rb * 4)[None, :, None] + tl.arange(0, 4)[None, None, :]
        raw = tl.load(q_ptr + rows * (K // 8) + rw, mask=bmask, other=0)
    sv = tl.load(s_ptr + rows * (K // 32) + rb[None, :, None], mask=bmask, other=0)
    return raw, sv


@triton.jit
def _dec3(raw, sv, tab_ptr, KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weights [BLOCK_N, BLOCK_K / 32, 32] (float32, one block a row of the last axis) from _load3's arrays, with
    the torch decoders' float32 operations."""
    if KIND == 1:
        q = raw.to(tl.float32)
    else:  # code i of a word at bits 4 * i
        sh = (tl.arange(0, 8) * 4)[None, None, None, :]
        q = tl.reshape((raw[:, :, :, None] >> sh) & 15, [BLOCK_N, BLOCK_K // 32, 32]).to(tl.float32)
    if KIND == 0:  # q4c: s * (q - zc / 16); a 16-bit word per block: c (low byte), zc (high byte)
        v = sv.to(tl.int32)
        s = tl.load(tab_ptr + (v & 255))  # always in the 256-entry table (0 outside the weight)
        z = ((v >> 8) & 255).to(tl.float32) / 16.0
        w = (q - z) * s
    else:  # fp16 d per block
        d = sv.to(tl.float32)
        if KIND == 1:
            w = q * d
        else:  # q4_0: d * (q - 8)
            w = (q - 8.0) * d
    return w


@triton.jit
def _decode3(q_ptr, s_ptr, tab_ptr, rn, k0, N, K, KIND: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr):
    raw, sv = _load3(q_ptr, s_ptr, rn, k0, N, K, KIND, BLOCK_N, BLOCK_K)
    return _dec3(raw, sv, tab_ptr, KIND, BLOCK_N, BLOCK_K)


@triton.jit
def _decode(q_ptr, s_ptr, tab_ptr, rn, k0, N, K, KIND: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """_decode3 as a [BLOCK_N, BLOCK_K] tile."""
    return tl.reshape(_decode3(q_ptr, s_ptr, tab_ptr, rn, k0, N, K, KIND, BLOCK_N, BLOCK_K), [BLOCK_N, BLOCK_K])


def _configs(dot: bool):
    if _INTERP:
        extra = {} if dot else {"BLOCKSUM": True, "PREFETCH": True}
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 64, **extra}, num_warps=4, num_stages=1)]
    if _ONE_CONFIG:  # INFERFLOW_TRITON_AUTOTUNE=0: skip the search (faster first calls), one likely-good config
        extra = {} if dot else {"BLOCKSUM": True, "PREFETCH": True}
        return [triton.Config({"BLOCK_N": 32 if dot else 16, "BLOCK_K": 128 if dot else 512, **extra}, num_warps=4,
                              num_stages=3 if dot else 1)]
    if dot:
        tiles = [(16, 128, 4, 3), (32, 128, 4, 3), (32, 256, 4, 2), (64, 128, 4, 3), (16, 256, 4, 3),
                 (64, 64, 4, 4), (32, 64, 2, 4)]
        return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s) for bn, bk, w, s in tiles]
    # (BLOCK_N, BLOCK_K, warps, BLOCKSUM, PREFETCH): per-block sums keep registers low, so their tiles are larger;
    # a prefetch holds the next tile's raw codes (an eighth / a quarter of the decoded tile's registers)
    tiles = [(8, 256, 4, False, False), (16, 256, 4, False, False), (8, 512, 8, False, False),
             (16, 512, 4, True, False), (32, 512, 8, True, False), (16, 1024, 8, True, False),
             (16, 256, 4, True, True), (16, 512, 4, True, True), (32, 256, 4, True, True),
             (32, 512, 8, True, True), (8, 1024, 4, True, True)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "BLOCKSUM": b, "PREFETCH": p}, num_warps=w, num_stages=1)
            for bn, bk, w, b, p in tiles]


@autotune(configs=_configs(False), key=["N", "K", "MP", "KIND"])
@triton.jit
def gemv_fma(x_ptr, q_ptr, s_ptr, tab_ptr, b_ptr, y_ptr, M, N, K, sxm, sym, HAS_BIAS: tl.constexpr,
             KIND: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCKSUM: tl.constexpr, PREFETCH: tl.constexpr):
    # MP rows: 1, or 2 (then M is 2). BLOCKSUM: reduce each block's 32 products every step (few registers: larger
    # tiles, more loads in flight), else keep elementwise partial products and reduce once after the loop
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if BLOCKSUM:
        acc0 = tl.full([BLOCK_N, BLOCK_K // 32], 0.0, tl.float32)
        acc1 = tl.full([BLOCK_N, BLOCK_K // 32], 0.0, tl.float32)
    else:
        acc0 = tl.full([BLOCK_N, BLOCK_K // 32, 32], 0.0, tl.float32)
        acc1 = tl.full([BLOCK_N, BLOCK_K // 32, 32], 0.0, tl.float32)
    if PREFETCH:
        raw, sv = _load3(q_ptr, s_ptr, rn, 0, N, K, KIND, BLOCK_N, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:  # the next tile's loads are issued before this one is used: twice the bytes in flight
            nraw, nsv = _load3(q_ptr, s_ptr, rn, k0 + BLOCK_K, N, K, KIND, BLOCK_N, BLOCK_K)
            w = _dec3(raw, sv, tab_ptr, KIND, BLOCK_N, BLOCK_K)
            raw, sv = nraw, nsv
        else:
            w = _decode3(q_ptr, s_ptr, tab_ptr, rn, k0, N, K, KIND, BLOCK_N, BLOCK_K)
        rk = k0 + tl.arange(0, BLOCK_K // 32)[:, None] * 32 + tl.arange(0, 32)[None, :]
        x0 = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        if BLOCKSUM:
            acc0 += tl.reduce(w * x0[None, :, :], 2, _add)
        else:
            acc0 += w * x0[None, :, :]
        if MP == 2:
            x1 = tl.load(x_ptr + sxm + rk, mask=rk < K, other=0.0).to(tl.float32)
            if BLOCKSUM:
                acc1 += tl.reduce(w * x1[None, :, :], 2, _add)
            else:
                acc1 += w * x1[None, :, :]
    if not BLOCKSUM:
        acc0 = tl.reduce(acc0, 2, _add)
        acc1 = tl.reduce(acc1, 2, _add)
    out0 = tl.reduce(acc0, 1, _add)
    nmask = rn < N
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        out0 += bias
    tl.store(y_ptr + rn, out0.to(y_ptr.dtype.element_ty), mask=nmask)
    if MP == 2:
        out1 = tl.reduce(acc1, 1, _add)
        if HAS_BIAS:
            out1 += bias
        tl.store(y_ptr + sym + rn, out1.to(y_ptr.dtype.element_ty), mask=nmask)


@autotune(configs=_configs(True), key=["N", "K", "KIND", "IEEE"])
@triton.jit
def gemv_dot(x_ptr, q_ptr, s_ptr, tab_ptr, b_ptr, y_ptr, M, N, K, sxm, sym, HAS_BIAS: tl.constexpr,
             KIND: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, 16)  # up to 16 rows, padded: tl.dot's minimum
    mmask = rm < M
    acc = tl.full([16, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = _decode(q_ptr, s_ptr, tab_ptr, rn, k0, N, K, KIND, BLOCK_N, BLOCK_K)
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :], mask=mmask[:, None] & (rk < K)[None, :], other=0.0)
        if IEEE:  # float32 activations, and the interpreter (its bf16 tl.dot is wrong)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    nmask = rn < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def dequant(q_ptr, s_ptr, tab_ptr, w_ptr, N, K, KIND: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """The decoded weight [N, K] into w_ptr (its dtype): one [BLOCK_N, BLOCK_K] tile per program."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    w = _decode(q_ptr, s_ptr, tab_ptr, rn, k0, N, K, KIND, BLOCK_N, BLOCK_K)
    rk = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], w.to(w_ptr.dtype.element_ty),
             mask=(rn < N)[:, None] & (rk < K)[None, :])
