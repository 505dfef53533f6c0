"""The 4-bit dequant-fused GEMM (more than 2 activation rows, up to triton_soa.GEMM_MAX_ROWS) and the whole-weight
decode, over the interleaved layout and with the exact decode of :mod:`inferflow.quant.triton_q4` (described there).

A module of its own only to keep files short; the decode helpers are triton_q4's.
"""
import triton
import triton.language as tl

from .triton_q4 import _INTERP, _ONE_CONFIG, GROUP, _block_terms, _graph_bench, _nibble, _weights, autotune


def _gemm_configs():
    if _INTERP:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BG": 1, "WHOLE": True}, num_warps=4, num_stages=1)]
    if _ONE_CONFIG:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BG": 1, "WHOLE": True}, num_warps=4, num_stages=2)]
    # (BLOCK_M, BLOCK_N, BG, warps, stages, WHOLE). WHOLE: the tile's 8 nibble slabs decoded at once into
    # [BLOCK_N, 256 BG] (natural column order) and ONE dot of depth 256 BG per step; else one dot per slab
    # (depth 32 BG; measured on an H200: slow at 64 rows, kept for the autotuner to weigh at 16). 2 stages: ~105
    # KB of shared memory at 64 x 64 (two programs an SM) instead of ~150 KB (one)
    tiles = [(16, 32, 1, 4, 3, True), (16, 64, 1, 4, 3, True), (16, 16, 1, 4, 3, True), (16, 64, 1, 4, 2, True),
             (32, 32, 1, 4, 3, True), (32, 64, 1, 4, 2, True), (64, 32, 1, 4, 3, True), (64, 64, 1, 4, 3, True),
             (64, 32, 1, 4, 2, True), (64, 64, 1, 4, 2, True), (64, 128, 1, 8, 3, True), (128, 64, 1, 8, 3, True),
             (128, 128, 1, 8, 3, True), (16, 32, 2, 4, 3, False), (16, 64, 1, 4, 3, False)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BG": bg, "WHOLE": wh}, num_warps=w, num_stages=st)
            for bm, bn, bg, w, st, wh in tiles]


def _prune(configs, named_args, **kwargs):
    """Row tiles no taller than the rows (padded to 16): a 16-row decode batch never tries 128-row tiles."""
    mb = max(16, named_args["MB"] if "MB" in named_args else kwargs.get("MB", 16))
    keep = [c for c in configs if c.kwargs["BLOCK_M"] <= mb]
    return keep or configs[:1]


@autotune(configs=_gemm_configs(), key=["MB", "N", "KW", "KIND", "IEEE"],
          prune_configs_by={"early_config_prune": _prune}, do_bench=_graph_bench)
@triton.heuristics({"EVEN": lambda a: a["K"] % (256 * a["BG"]) == 0})
@triton.jit
def gemm4(x_ptr, q_ptr, s_ptr, tab_ptr, b_ptr, y_ptr, M, N, K, KW, sxm, sym, MB, HAS_BIAS: tl.constexpr,
          KIND: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BG: tl.constexpr,
          WHOLE: tl.constexpr, EVEN: tl.constexpr):
    # MB: rows rounded up to a power of two (the autotune key: prefills of any length share configs)
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = rm < M
    rows = tl.minimum(rn, N - 1).to(tl.int64)[:, None, None]
    g3 = tl.arange(0, BG)[None, :, None]
    j3 = tl.arange(0, 32)[None, None, :]
    ng = KW // 32
    e0 = tl.where(KW > 0, 150 << 23, 0)  # see gemv4
    qp = q_ptr + rows * KW + g3 * 32 + j3
    srow = s_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * (KW // 4)  # [BN, 1]
    sp = srow + tl.arange(0, BG)[None, :] * 8  # [BN, BG]
    c = tl.arange(0, BG * 32)
    xp = x_ptr + rm.to(tl.int64)[:, None] * sxm + ((c // 32) * GROUP + c % 32)[None, :]  # [BM, 32 BG], nibble 0
    xc = ((c // 32) * GROUP + c % 32)[None, :]
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for g0 in range(0, ng, BG):
        gmask = (g0 + g3) < ng
        if EVEN:
            raw = tl.load(qp + g0 * 32)
        else:
            raw = tl.load(qp + g0 * 32, mask=gmask, other=0)
        if WHOLE:
            acc = _whole_step(acc, raw, srow, x_ptr, tab_ptr, rm, mmask, sxm, g0, ng, K, e0, KIND, IEEE, BLOCK_N, BG,
                              EVEN)
        else:
            lo = raw << 8
            hi = raw >> 12
            for i in tl.static_range(8):
                if EVEN:
                    sv = tl.load(sp + g0 * 8 + i)
                    x = tl.load(xp + g0 * GROUP + i * 32, mask=mmask[:, None], other=0.0)
                else:
                    sv = tl.load(sp + g0 * 8 + i, mask=(g0 + tl.arange(0, BG) < ng)[None, :], other=0)
                    x = tl.load(xp + g0 * GROUP + i * 32, mask=mmask[:, None] & (g0 * GROUP + i * 32 + xc < K),
                                other=0.0)
                f, base = _nibble(raw, lo, hi, i, e0)
                a, b = _block_terms(sv, base, tab_ptr, KIND)
                w = tl.reshape(_weights(f, a[:, :, None], b[:, :, None], KIND), [BLOCK_N, BG * 32])
                acc = _dot(acc, x, w, IEEE)
    nmask = rn < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _dot(acc, x, w, IEEE: tl.constexpr):
    """acc + x @ w^T: IEEE float32 for float32 activations and the interpreter (its bf16 tl.dot is wrong), else
    w rounded to the activations' dtype, float32 accumulation."""
    if IEEE:
        return acc + tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w.to(x.dtype)))


@triton.jit
def _whole_step(acc, raw, srow, x_ptr, tab_ptr, rm, mmask, sxm, g0, ng, K, e0, KIND: tl.constexpr,
                IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BG: tl.constexpr, EVEN: tl.constexpr):
    """gemm4's step over groups g0..g0+BG-1 decoded at once: nibble i of every word (shift 4i) into the exponent
    of 2^23 (2^23 + q exactly), [BLOCK_N, BG, 8, 32] = columns 256 g + 32 i + j in order, one dot of depth 256 BG."""
    sh = (tl.arange(0, 8) * 4)[None, None, :, None]
    f = (((raw[:, :, None, :] >> sh) & 15) | e0).to(tl.float32, bitcast=True)  # [BN, BG, 8, 32]
    s8 = tl.arange(0, BG * 8)[None, :]
    if EVEN:
        sv = tl.load(srow + g0 * 8 + s8)  # [BN, 8 BG]: the blocks' scales in order
    else:
        sv = tl.load(srow + g0 * 8 + s8, mask=g0 + s8 // 8 < ng, other=0)
    # per-block terms converted before the broadcast over a block's 32 weights (one conversion per block)
    if KIND == 2:  # q4_0: (q - 8) * d, f - (2^23 + 8) = q - 8 exactly
        d = tl.reshape(sv.to(tl.float32), [BLOCK_N, BG, 8])[:, :, :, None]
        w = (f - 8388616.0) * d
    else:  # q4c: (q - zc / 16) * s
        v = sv.to(tl.int32)
        z = tl.reshape(((v >> 8) & 255).to(tl.float32) / 16.0, [BLOCK_N, BG, 8])[:, :, :, None]
        sc = tl.reshape(tl.load(tab_ptr + (v & 255)), [BLOCK_N, BG, 8])[:, :, :, None]
        w = ((f - 8388608.0) - z) * sc
    w = tl.reshape(w, [BLOCK_N, BG * GROUP])
    kc = g0 * GROUP + tl.arange(0, BG * GROUP)[None, :]
    if EVEN:
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * sxm + kc, mask=mmask[:, None], other=0.0)
    else:
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * sxm + kc, mask=mmask[:, None] & (kc < K), other=0.0)
    return _dot(acc, x, w, IEEE)


@triton.jit
def dequant4(q_ptr, s_ptr, tab_ptr, w_ptr, N, K, KW, KIND: tl.constexpr, BLOCK_N: tl.constexpr,
             BG: tl.constexpr):
    """The decoded weight [N, K] into w_ptr (its dtype): one [BLOCK_N, BG groups] tile per program."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g0 = tl.program_id(1) * BG
    rows = tl.minimum(rn, N - 1).to(tl.int64)[:, None, None]
    g3 = tl.arange(0, BG)[None, :, None]
    j3 = tl.arange(0, 32)[None, None, :]
    gmask = (g0 + g3) < KW // 32
    raw = tl.load(q_ptr + rows * KW + (g0 + g3) * 32 + j3, mask=gmask, other=0)
    lo = raw << 8
    hi = raw >> 12
    g2 = g0 + tl.arange(0, BG)[None, :]
    e0 = tl.where(KW > 0, 150 << 23, 0)
    for i in tl.static_range(8):
        sv = tl.load(s_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * (KW // 4) + g2 * 8 + i,
                     mask=g2 < KW // 32, other=0)
        f, base = _nibble(raw, lo, hi, i, e0)
        a, b = _block_terms(sv, base, tab_ptr, KIND)
        w = _weights(f, a[:, :, None], b[:, :, None], KIND)
        col = (g0 + g3) * GROUP + i * 32 + j3
        tl.store(w_ptr + rn.to(tl.int64)[:, None, None] * K + col, w.to(w_ptr.dtype.element_ty),
                 mask=(rn < N)[:, None, None] & (col < K))
