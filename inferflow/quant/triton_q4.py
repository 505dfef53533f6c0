"""Triton kernels for 4-bit weights (q4_0, inferflow q4 = q4c) in the interleaved SoA layout of quant/triton_soa.py.

Layout (made once at load, same 4.5 bits per weight): a row's columns are padded to whole groups of 256 (8 blocks);
group g holds 32 int32 words, and nibble i (bits 4i..4i+3) of word j is column 256 g + 32 i + j, i.e. nibble i of
the group's 32 words is exactly block 8 g + i. So a tile of words decodes nibble by nibble into [rows, 32] slabs
that each need ONE block scale per row and 32 contiguous activations, with no layout shuffles.

Decoding without int->float conversions (a quarter-rate instruction): nibble i, moved to bit position 4p with p in
{2, 3, 4} (one shift per word for nibbles 0-1 and 5-7), OR'd into the exponent of 2^(23 - 4p) reads as the float
f = 2^(23 - 4p) + q exactly (one LOP3). q4_0: fma(f, d, -(2^(23 - 4p) + 8) d) is the decoder's d * (q - 8)
exactly (one rounding of an exactly representable value; the per-block constant fits 24 bits for p >= 2); q4c:
(f - (2^(23 - 4p) + zc / 16)) * s = s * (q - zc / 16), as the torch decoder. So the weights are bit-identical and
a q4_0 weight costs ~5 instructions on sm_90 (LOP3, 2 FFMA, and shares of the shifts, activation conversions and
per-block terms), compiled with tools/compile_triton_quant.py.

- ``gemv4``: 1-2 activation rows (decode): float32 FMAs, a program owns BLOCK_N rows (2-4 per thread: one
  activation conversion serves them) over all of K, or over one of SPLIT parts of it (split-K, narrow outputs:
  float32 partials, summed by the tile's last program, no extra launch), loading the next tile's codes early.
- ``gemm4`` (triton_q4_gemm.py): more rows (to 256): dequant-fused ``tl.dot`` (bf16/fp16 operands, float32 accumulate; IEEE float32
  for float32 activations and under the interpreter), rows tiled by BLOCK_M; WHOLE decodes all 8 nibble slabs of
  a step into one [BLOCK_N, 256 BG] tile in natural column order (one dot of depth 256 BG), else a dot per slab.
- ``dequant4`` (triton_q4_gemm.py): the weight decoded whole (longer prefills: then one cuBLAS matmul).

Both matmuls autotune per shape with configs timed as CUDA-graph replays, L2 flushed between calls (as a decode
step runs them: weights from HBM, no host launch cost).
"""
import inspect
import os

import triton
import triton.language as tl
import triton.testing

_INTERP = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_ONE_CONFIG = os.environ.get("INFERFLOW_TRITON_AUTOTUNE", "1") == "0"


def autotune(**kw):
    """``triton.autotune`` that keeps its picks in Triton's on-disk cache (``cache_results``) where this Triton has
    it, so that the next process does not time the configs again: the 4-bit kernels' tuning was seconds of every
    engine start (docs/benchmarks.md, start-up)."""
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        kw.setdefault("cache_results", True)
    return triton.autotune(**kw)
GROUP = tl.constexpr(256)  # columns per packing group (a constexpr: kernels read it)


@triton.jit
def _add(a, b):
    return a + b  # tl.sum's combine function may predate TRITON_INTERPRET (see triton_ops.add)


@triton.jit
def _nibble(raw, lo, hi, I: tl.constexpr, E0):
    """Nibble I of every word as the exact float 2^(23 - 4p) + q; returns (float, 2^(23 - 4p)). E0: 150 << 23
    (the exponent of 2^23), passed as a run-time value (see gemv4)."""
    if I < 2:  # lo = raw << 8: nibbles 0, 1 at positions 2, 3
        bits = (lo & (15 << (4 * (I + 2)))) | (E0 - ((4 * (I + 2)) << 23))
        base = 1 << (23 - 4 * (I + 2))
    elif I < 5:  # nibbles 2, 3, 4 in place
        bits = (raw & (15 << (4 * I))) | (E0 - ((4 * I) << 23))
        base = 1 << (23 - 4 * I)
    else:  # hi = raw >> 12: nibbles 5, 6, 7 at positions 2, 3, 4
        bits = (hi & (15 << (4 * (I - 3)))) | (E0 - ((4 * (I - 3)) << 23))
        base = 1 << (23 - 4 * (I - 3))
    return bits.to(tl.float32, bitcast=True), base


@triton.jit
def _block_terms(sv, base, tab_ptr, KIND: tl.constexpr):
    """Per-block (scale, offset) of a nibble slab from its 16-bit block scales sv ([rows, groups], before the
    broadcast over the 32 words: one conversion per block, not per weight); base = 2^(23 - 4p)."""
    if KIND == 2:  # q4_0: d * (q - 8) = fma(f, d, -(base + 8) d), exact: (base + 8) d fits 24 bits for p >= 2
        d = sv.to(tl.float32)
        return d, -(base + 8) * d
    else:  # q4c: s * (q - zc / 16) = (f - (base + zc / 16)) * s, s = tab[c]; c the low byte, zc the high byte
        v = sv.to(tl.int32)
        s = tl.load(tab_ptr + (v & 255))
        return s, ((v >> 8) & 255).to(tl.float32) / 16.0 + base


@triton.jit
def _weights(f, a, b, KIND: tl.constexpr):
    """Decoded float32 weights of a nibble slab (f from _nibble), (a, b) its _block_terms expanded to 3-D."""
    if KIND == 2:
        w = tl.fma(f, a, b)  # one rounding of the exact (q - 8) d: exactly the decoder's weight
    else:
        w = (f - b) * a  # f - (base + z) = q - z exactly
    return w


FLUSH_BYTES = 128 << 20  # autotune timing: this much is written before each call, so weights come from HBM (L2 < it)
_flush: dict = {}


def _flushed_graph_ms(kernel_call, reps: int = 8, rounds: int = 5) -> float:
    """GPU ms of one ``kernel_call`` as CUDA-graph replays with the L2 cache flushed before each call: a graph of
    (flush, call) x reps minus a graph of flush x reps. Without the flush, a 10-50 MB weight stays in L2 and the
    configs are ranked at L2 speed; in a decode step every weight comes from HBM."""
    import torch

    dev = torch.cuda.current_device()
    if dev not in _flush:
        with torch.inference_mode(False):
            _flush[dev] = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    flush = _flush[dev]

    def median_ms(with_kernel: bool) -> float:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            flush.zero_()
            if with_kernel:
                kernel_call()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for _ in range(reps):
                flush.zero_()
                if with_kernel:
                    kernel_call()
        times = []
        for _ in range(rounds):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1))
        return sorted(times)[len(times) // 2]

    return max(median_ms(True) - median_ms(False), 1e-4) / reps


def _graph_bench(kernel_call, quantiles):
    """The autotuner's timer: CUDA-graph replays (as the engine runs the kernels; timed one launch at a time, a
    kernel of a few microseconds measures the host's launch cost and the pick is noise: seen on an H200), with L2
    flushed between calls; Triton's graph timer (no flush) if that fails."""
    try:
        t = _flushed_graph_ms(kernel_call)
    except Exception:  # noqa: BLE001 - a timer problem must not fail the matmul: Triton's own graph timer
        return triton.testing.do_bench_cudagraph(kernel_call, rep=20, quantiles=quantiles)
    return [t] * len(quantiles) if quantiles else t


def _gemv_configs():
    if _INTERP:
        return [triton.Config({"BLOCK_N": 8, "BG": 1, "PREFETCH": True, "SPLIT": 1}, num_warps=4, num_stages=1)]
    if _ONE_CONFIG:
        return [triton.Config({"BLOCK_N": 16, "BG": 1, "PREFETCH": True, "SPLIT": 1}, num_warps=2, num_stages=1)]
    # (BLOCK_N, BG, warps, PREFETCH, SPLIT): 128 B of codes per row and group; 2-4 rows per thread (one bf16 ->
    # float conversion of an activation serves them all: 32 rows on 2 warps compile to ~5 instructions per weight
    # for sm_90); SPLIT > 1 for narrow outputs (N = 4096: 128-256 programs would leave SMs short of loads in
    # flight). Measured on an H200 (M = 1, 4096 x 151936): 16 rows, 2 warps, no split: 2.1 TB/s
    tiles = [(16, 1, 2, True, 1), (32, 1, 2, True, 1), (64, 1, 4, True, 1), (32, 1, 4, True, 1), (16, 2, 4, True, 1),
             (16, 1, 2, False, 1), (16, 1, 2, True, 2), (16, 1, 2, True, 4), (32, 1, 2, True, 2), (32, 1, 2, True, 4),
             (32, 1, 4, True, 4), (32, 1, 2, True, 8)]
    return [triton.Config({"BLOCK_N": bn, "BG": bg, "PREFETCH": p, "SPLIT": sk}, num_warps=w, num_stages=1)
            for bn, bg, w, p, sk in tiles]


SPLIT_MAX_N = 16384  # split-K only for outputs up to this wide (the partial-sum workspace is sized for it)
SPLIT_MAX = 8


def _prune_gemv(configs, named_args, **kwargs):
    """Split-K only where it fits the workspace and leaves each split at least 2 groups of 256 columns."""
    n, ng = named_args["N"], named_args["KW"] // 32
    keep = [c for c in configs if c.kwargs["SPLIT"] == 1
            or (n <= SPLIT_MAX_N and ng >= 2 * c.kwargs["SPLIT"] * c.kwargs["BG"])]
    return keep or configs[:1]


@autotune(configs=_gemv_configs(), key=["N", "KW", "MP", "KIND"],
          prune_configs_by={"early_config_prune": _prune_gemv}, do_bench=_graph_bench)
@triton.heuristics({"EVEN": lambda a: a["K"] % (256 * a["BG"] * a["SPLIT"]) == 0})
@triton.jit
def gemv4(x_ptr, q_ptr, s_ptr, tab_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, N, K, KW, sxm, sym, HAS_BIAS: tl.constexpr,
          KIND: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr, BG: tl.constexpr, PREFETCH: tl.constexpr,
          SPLIT: tl.constexpr, EVEN: tl.constexpr):
    # KW: code words per (padded) row; K: real columns (activations beyond K read as 0). SPLIT > 1: program
    # (n, s) sums split s of the groups into float32 partials ws[s, row, n]; the program that finishes its tile
    # last (a counter per tile, reset by it) adds the SPLIT partials and stores the output: no extra launch.
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.minimum(rn, N - 1).to(tl.int64)  # rows past N re-read row N - 1; never stored
    g3 = tl.arange(0, BG)[None, :, None]
    g2 = tl.arange(0, BG)[None, :]
    j3 = tl.arange(0, 32)[None, None, :]
    ng = KW // 32  # groups per row
    e0 = tl.where(KW > 0, 150 << 23, 0)  # the exponent of 2^23 as a run-time value: held in a register, not
    # re-made from an immediate at every use (ptxas does that for constants: ~1 extra instruction per weight)
    gps = tl.cdiv(tl.cdiv(ng, SPLIT), BG) * BG  # groups per split, whole tiles
    g_lo = tl.program_id(1) * gps
    g_hi = tl.minimum(ng, g_lo + gps)
    qp = q_ptr + rc[:, None, None] * KW + g3 * 32 + j3  # [BN, BG, 32] words of groups 0..BG-1
    sp = s_ptr + rc[:, None] * (KW // 4) + g2 * 8  # [BN, BG] the scale of block 8 g (+ i)
    xo = g3 * GROUP + j3  # [1, BG, 32] column of nibble 0
    acc0 = tl.full([BLOCK_N, BG, 32], 0.0, tl.float32)
    acc1 = tl.full([BLOCK_N, BG, 32], 0.0, tl.float32)
    if PREFETCH:
        if EVEN:
            raw = tl.load(qp + g_lo * 32)
        else:
            raw = tl.load(qp + g_lo * 32, mask=g_lo + g3 < g_hi, other=0)
    for g0 in range(g_lo, g_hi, BG):
        if PREFETCH:  # the next tile's codes are in flight while this one is decoded
            if EVEN:
                nraw = tl.load(qp + tl.minimum(g0 + BG, g_hi - BG) * 32)
            else:
                nraw = tl.load(qp + (g0 + BG) * 32, mask=(g0 + BG + g3) < g_hi, other=0)
        else:
            if EVEN:
                raw = tl.load(qp + g0 * 32)
            else:
                raw = tl.load(qp + g0 * 32, mask=(g0 + g3) < g_hi, other=0)
        lo = raw << 8
        hi = raw >> 12
        for i in tl.static_range(8):
            xk = g0 * GROUP + i * 32 + xo
            if EVEN:
                sv = tl.load(sp + g0 * 8 + i)
                x0 = tl.load(x_ptr + xk).to(tl.float32)
            else:
                sv = tl.load(sp + g0 * 8 + i, mask=(g0 + g2) < g_hi, other=0)
                x0 = tl.load(x_ptr + xk, mask=xk < K, other=0.0).to(tl.float32)
            f, base = _nibble(raw, lo, hi, i, e0)
            a, b = _block_terms(sv, base, tab_ptr, KIND)
            w = _weights(f, a[:, :, None], b[:, :, None], KIND)
            acc0 += w * x0
            if MP == 2:
                if EVEN:
                    x1 = tl.load(x_ptr + sxm + xk).to(tl.float32)
                else:
                    x1 = tl.load(x_ptr + sxm + xk, mask=xk < K, other=0.0).to(tl.float32)
                acc1 += w * x1
        if PREFETCH:
            raw = nraw
    nmask = rn < N
    out0 = tl.reduce(tl.reduce(acc0, 2, _add), 1, _add)
    out1 = tl.reduce(tl.reduce(acc1, 2, _add), 1, _add)
    if SPLIT > 1:
        wp = ws_ptr + (tl.program_id(1) * 2) * N + rn
        tl.store(wp, out0, mask=nmask)
        if MP == 2:
            tl.store(wp + N, out1, mask=nmask)
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")  # releases the partials, acquires the others'
        if done == SPLIT - 1:  # the last split of this tile: sum the partials (bypassing L1: .cg) and store
            out0 = tl.full([BLOCK_N], 0.0, tl.float32)
            out1 = tl.full([BLOCK_N], 0.0, tl.float32)
            for sk in tl.static_range(SPLIT):
                out0 += tl.load(ws_ptr + sk * 2 * N + rn, mask=nmask, other=0.0, cache_modifier=".cg")
                if MP == 2:
                    out1 += tl.load(ws_ptr + (sk * 2 + 1) * N + rn, mask=nmask, other=0.0, cache_modifier=".cg")
            _finish(out0, out1, b_ptr, y_ptr, rn, nmask, sym, HAS_BIAS, MP)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next call (CUDA-graph replays included)
    else:
        _finish(out0, out1, b_ptr, y_ptr, rn, nmask, sym, HAS_BIAS, MP)


@triton.jit
def _finish(out0, out1, b_ptr, y_ptr, rn, nmask, sym, HAS_BIAS: tl.constexpr, MP: tl.constexpr):
    if HAS_BIAS:
        bias = tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        out0 += bias
        out1 += bias
    tl.store(y_ptr + rn, out0.to(y_ptr.dtype.element_ty), mask=nmask)
    if MP == 2:
        tl.store(y_ptr + sym + rn, out1.to(y_ptr.dtype.element_ty), mask=nmask)
