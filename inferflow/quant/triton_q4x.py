"""Triton GEMV for 4-bit blocks (q4_0, inferflow q4 = q4c) on int8 activations, for decode-sized calls (1-2 rows).

This is llama.cpp's arithmetic for these blocks (its CUDA ``vec_dot_q4_0_q8_1``). The float32 GEMV
(triton_q4.gemv4) decodes every weight to float32, about 5 instructions per weight on sm_90, and stays near 2 TB/s:
issue-bound, short of the H200's ~4.2 TB/s. Here 8 weights cost about 5 instructions. A 32-bit word of a block's
codes holds 8 nibbles. Masked (``& 0x0F0F0F0F``, and again after ``>> 4``), it gives two words of 4 byte-sized codes.
``dp4a`` multiplies each with 4 int8 activations and adds them in one instruction.

Activations: the kernel quantizes each 32-column block of x as it goes, as llama.cpp's q8_1 does. The scale is
``dx = absmax / 127`` and the codes are ``qx = floor(x / dx + 0.5)``. Every program quantizes the x columns it
reads: a few instructions per column, against BLOCK_N weights per column. Per block and row:

    q4_0: d * (dx * sum(q * qx) - 8 * dx * sum(qx))            (w = d * (q - 8))
    q4c:  s * (dx * sum(q * qx) - zc / 16 * dx * sum(qx))      (w = s * (q - zc / 16), s = SCALES[c])

The integer sums are exact, so the error is x's int8 rounding (relative ~1/254 of a block's largest activation),
as in llama.cpp. The weights are read as stored: 18-byte blocks, a 2-byte header and 16 code bytes, rows of whole
blocks, so 2-byte aligned. No repacked copy is made; the 16-bit loads of a warp cover whole rows, and L1 merges
them. ``INFERFLOW_TRITON_Q8X=0`` keeps the float32 GEMV.
"""
import os

import triton
import triton.language as tl

from .triton_q4 import SPLIT_MAX_N, _finish, _graph_bench

_INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_ONE_CONFIG = os.environ.get("INFERFLOW_TRITON_AUTOTUNE", "1") == "0"


def enabled() -> bool:
    """Whether decode-sized 4-bit calls take this kernel ($INFERFLOW_TRITON_Q8X, default on)."""
    return os.environ.get("INFERFLOW_TRITON_Q8X", "1") != "0"


@triton.jit
def _dp4a(a, b, c, INTERP: tl.constexpr):
    """c + the dot product of a's and b's 4 signed bytes (a's are codes 0..15)."""
    if INTERP:  # the interpreter runs no PTX: the same sum byte by byte
        s = c
        for e in tl.static_range(4):
            s += ((a >> (8 * e)) & 255) * ((b << (24 - 8 * e)) >> 24)
        return s
    else:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _quant_x(x_ptr, blk, bmask):
    """Blocks ``blk`` [BB] of one activation row as int8 codes packed 4 to a word: (lo [BB, 4]: columns 0-15,
    hi [BB, 4]: columns 16-31, the words a block's code words pair with), dx [BB], dx * sum(qx) [BB]."""
    w4 = tl.arange(0, 4)[None, :, None]
    e4 = tl.arange(0, 4)[None, None, :]
    col = blk[:, None, None] * 32 + w4 * 4 + e4
    m3 = bmask[:, None, None]
    lo = tl.load(x_ptr + col, mask=m3, other=0.0).to(tl.float32)
    hi = tl.load(x_ptr + col + 16, mask=m3, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(lo), 2), 1), tl.max(tl.max(tl.abs(hi), 2), 1))
    dx = amax / 127.0
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)[:, None, None]
    ql = tl.floor(lo * inv + 0.5).to(tl.int32)
    qh = tl.floor(hi * inv + 0.5).to(tl.int32)
    sx = (tl.sum(tl.sum(ql, 2), 1) + tl.sum(tl.sum(qh, 2), 1)).to(tl.float32) * dx
    # disjoint bytes: their sum is their bitwise or
    xlo = tl.sum((ql & 255) << (8 * e4), 2)
    xhi = tl.sum((qh & 255) << (8 * e4), 2)
    return xlo, xhi, dx, sx


@triton.jit
def quant_x8(x_ptr, xq_ptr, xs_ptr, K, sxm, BB: tl.constexpr):
    """Activation rows quantized once per call for :func:`gemv4x` (grid: (blocks / BB, rows)): int8 codes packed 4
    to a word (xq [M, K / 4]) and per block dx, dx * sum(qx) (xs [M, 2, K / 32])."""
    m = tl.program_id(1)
    nb = K // 32
    blk = tl.program_id(0) * BB + tl.arange(0, BB)
    bmask = blk < nb
    xlo, xhi, dx, sx = _quant_x(x_ptr + m * sxm, blk, bmask)
    w4 = tl.arange(0, 4)[None, :]
    qp = xq_ptr + m * (K // 4) + blk[:, None] * 8 + w4
    tl.store(qp, xlo, mask=bmask[:, None])
    tl.store(qp + 4, xhi, mask=bmask[:, None])
    tl.store(xs_ptr + m * 2 * nb + blk, dx, mask=bmask)
    tl.store(xs_ptr + m * 2 * nb + nb + blk, sx, mask=bmask)


@triton.jit
def _row(q, a, off, xq_ptr, xs_ptr, nb, blk, bmask, INTERP: tl.constexpr):
    """One activation row's [BN, BB] block sums against code words q [BN, BB, 4] (x from quant_x8)."""
    w4 = tl.arange(0, 4)[None, :]
    qp = xq_ptr + blk[:, None] * 8 + w4
    xlo = tl.load(qp, mask=bmask[:, None], other=0)
    xhi = tl.load(qp + 4, mask=bmask[:, None], other=0)
    dx = tl.load(xs_ptr + blk, mask=bmask, other=0.0)
    sx = tl.load(xs_ptr + nb + blk, mask=bmask, other=0.0)
    zero = tl.zeros(q.shape, tl.int32)
    s = _dp4a(q & 0x0F0F0F0F, xlo[None, :, :], _dp4a((q >> 4) & 0x0F0F0F0F, xhi[None, :, :], zero, INTERP), INTERP)
    si = tl.sum(s, 2).to(tl.float32)
    return a * (dx[None, :] * si - off * sx[None, :])


def _configs():
    if _INTERP:
        return [triton.Config({"BLOCK_N": 8, "BB": 2, "SPLIT": 1}, num_warps=4, num_stages=1)]
    if _ONE_CONFIG:
        return [triton.Config({"BLOCK_N": 32, "BB": 8, "SPLIT": 1}, num_warps=4, num_stages=1)]
    tiles = [(16, 8, 2, 1), (32, 8, 4, 1), (64, 8, 4, 1), (32, 4, 2, 1), (64, 4, 4, 1), (32, 16, 4, 1),
             (32, 8, 4, 2), (32, 8, 4, 4), (16, 8, 2, 4), (32, 4, 2, 4), (16, 8, 2, 8), (64, 8, 8, 2)]
    return [triton.Config({"BLOCK_N": bn, "BB": bb, "SPLIT": sk}, num_warps=w, num_stages=1) for bn, bb, w, sk in tiles]


def _prune(configs, named_args, **kwargs):
    """Split-K only where the workspace holds the output and each split keeps 2 tiles of blocks."""
    n, nb = named_args["N"], named_args["K"] // 32
    keep = [c for c in configs if c.kwargs["SPLIT"] == 1
            or (n <= SPLIT_MAX_N and nb >= 2 * c.kwargs["SPLIT"] * c.kwargs["BB"])]
    return keep or configs[:1]


@triton.autotune(configs=_configs(), key=["N", "K", "MP", "KIND", "SOA"], prune_configs_by={"early_config_prune": _prune},
                 do_bench=_graph_bench)
@triton.heuristics({"EVEN": lambda a: (a["K"] // 32) % (a["BB"] * a["SPLIT"]) == 0})
@triton.jit
def gemv4x(xq_ptr, xs_ptr, w_ptr, s_ptr, tab_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, RW, sym,
           HAS_BIAS: tl.constexpr, KIND: tl.constexpr, MP: tl.constexpr, INTERP: tl.constexpr, SOA: tl.constexpr,
           BLOCK_N: tl.constexpr, BB: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr):
    # w_ptr: the blocks as int16 [N, RW] (RW = 9 per block: the header, then 8 pairs of code bytes). SPLIT > 1:
    # program (n, s) sums split s of the blocks into float32 partials; the tile's last program adds them (gemv4's)
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.minimum(rn, N - 1).to(tl.int64)  # rows past N re-read row N - 1; never stored
    nb = K // 32
    bps = tl.cdiv(tl.cdiv(nb, SPLIT), BB) * BB  # blocks per split, whole tiles
    b_lo = tl.program_id(1) * bps
    b_hi = tl.minimum(nb, b_lo + bps)
    row = w_ptr + rc[:, None] * RW  # [BN, 1]
    w4 = tl.arange(0, 4)[None, None, :]
    acc0 = tl.zeros([BLOCK_N, BB], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BB], tl.float32)
    for b0 in range(b_lo, b_hi, BB):
        blk = b0 + tl.arange(0, BB)
        bmask = blk < b_hi
        if SOA:  # int32 codes [N, RW] (4 words a block), int16 headers [N, nb]
            cp = row[:, :, None] + blk[None, :, None] * 4 + w4
            hp = s_ptr + rc[:, None] * nb + blk[None, :]
            if EVEN:
                sv = tl.load(hp)
                q = tl.load(cp)
            else:
                sv = tl.load(hp, mask=bmask[None, :], other=0)
                q = tl.load(cp, mask=bmask[None, :, None], other=0)
        else:
            hp = row + blk[None, :] * 9  # [BN, BB] block headers
            cp = hp[:, :, None] + 1 + 2 * w4  # [BN, BB, 4] the low half of each code word
            if EVEN:
                sv = tl.load(hp)
                lo16 = tl.load(cp)
                hi16 = tl.load(cp + 1)
            else:
                sv = tl.load(hp, mask=bmask[None, :], other=0)
                lo16 = tl.load(cp, mask=bmask[None, :, None], other=0)
                hi16 = tl.load(cp + 1, mask=bmask[None, :, None], other=0)
            q = (lo16.to(tl.int32) & 0xFFFF) | (hi16.to(tl.int32) << 16)
        if KIND == 2:  # q4_0: fp16 d, codes offset by 8
            a = sv.to(tl.float16, bitcast=True).to(tl.float32)
            off = 8.0
        else:  # q4c: the log-scale table's s = SCALES[c] (low byte), zero zc / 16 (high byte)
            v = sv.to(tl.int32)
            a = tl.load(tab_ptr + (v & 255))
            off = ((v >> 8) & 255).to(tl.float32) / 16.0
        acc0 += _row(q, a, off, xq_ptr, xs_ptr, nb, blk, bmask, INTERP)
        if MP == 2:
            acc1 += _row(q, a, off, xq_ptr + K // 4, xs_ptr + 2 * nb, nb, blk, bmask, INTERP)
    nmask = rn < N
    out0 = tl.sum(acc0, 1)
    out1 = tl.sum(acc1, 1)
    if SPLIT > 1:
        wp = ws_ptr + (tl.program_id(1) * 2) * N + rn
        tl.store(wp, out0, mask=nmask)
        if MP == 2:
            tl.store(wp + N, out1, mask=nmask)
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")  # releases the partials, acquires the others'
        if done == SPLIT - 1:
            out0 = tl.zeros([BLOCK_N], tl.float32)
            out1 = tl.zeros([BLOCK_N], tl.float32)
            for sk in tl.static_range(SPLIT):
                out0 += tl.load(ws_ptr + sk * 2 * N + rn, mask=nmask, other=0.0, cache_modifier=".cg")
                if MP == 2:
                    out1 += tl.load(ws_ptr + (sk * 2 + 1) * N + rn, mask=nmask, other=0.0, cache_modifier=".cg")
            _finish(out0, out1, b_ptr, y_ptr, rn, nmask, sym, HAS_BIAS, MP)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next call (CUDA-graph replays included)
    else:
        _finish(out0, out1, b_ptr, y_ptr, rn, nmask, sym, HAS_BIAS, MP)
