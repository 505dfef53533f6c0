"""The 4-bit dequant-fused GEMM with its operands swapped (``y^T = W x^T``), for batched decode (triton_soa.SWAP_ROWS
rows of 16-bit activations), over quant/triton_soa.py's interleaved layout and triton_q4's exact decode.

Why swapped: Hopper's warpgroup MMA (``wgmma``) takes its M side in tiles of 64 and its A operand from registers.
A decode batch is a few to 64 rows, so in ``x @ W^T`` (triton_q4_gemm.gemm4) the batch is the M side and the weight,
decoded in registers, has to go through shared memory as the B operand. Here the weight's rows are the M side (64
per program) and stay in registers; the activations, the small operand, are B, staged in shared memory by
Triton's pipeliner.

A group's 32 code words decode as [rows, 8 nibbles, 32 words]: nibble i of word j is column 32 i + j, so that
flattens to [rows, 256] in column order, and the activations load as contiguous rows (pipelined into shared memory).

Narrow outputs (qkv, o, down: 64-96 programs of 64 rows for 132 SMs) split K: each split stores float32
partials, and the program that finishes a tile last adds them in split order (the result does not depend on
timing) and resets the tile's counter, so no second launch, and CUDA-graph replays reuse the buffers.
"""
import torch
import triton
import triton.language as tl

from .triton_q4 import _INTERP, _ONE_CONFIG, _graph_bench, autotune

MAX_TILE_ROWS = 64  # activation rows per program: more rows re-read the weight once per 64
SPLIT_WS_FLOATS = 1 << 22  # float32 partials the split-K workspace holds (16 MB): SPLIT x rows x N at most
SPLIT_TILES = 1 << 14  # per-tile counters


def tile_rows(m: int) -> int:
    """Activation rows per program for ``m`` rows: a power of two, 16 to :data:`MAX_TILE_ROWS`."""
    return min(MAX_TILE_ROWS, max(16, 1 << (m - 1).bit_length()))


def _configs():
    if _INTERP:
        return [triton.Config({"BLOCK_N": 16, "SPLIT": 2}, num_warps=4, num_stages=1)]
    if _ONE_CONFIG:
        return [triton.Config({"BLOCK_N": 64, "SPLIT": 2}, num_warps=4, num_stages=3)]
    # (BLOCK_N, warps, stages, SPLIT): 64 weight rows, one warpgroup's wgmma M. The configs that won a Qwen3-8B
    # shape at 4-32 rows on an H200 (tools/bench_q4_swap_gpu.py); 128-row tiles on 4 or 8 warps and splits of 8
    # won none
    tiles = [(64, 4, 3, 2), (64, 4, 3, 4), (64, 4, 4, 4), (64, 4, 2, 1), (64, 4, 3, 1)]
    return [triton.Config({"BLOCK_N": bn, "SPLIT": sk}, num_warps=w, num_stages=st) for bn, w, st, sk in tiles]


def _fits(split: int, block_n: int, n: int, ng: int, mb: int) -> bool:
    """A split of K fits: its partials the workspace, its tiles the counters, and each split has 2 groups."""
    tiles = -(-n // block_n) * -(-mb // MAX_TILE_ROWS)
    return split == 1 or (split * mb * n <= SPLIT_WS_FLOATS and tiles <= SPLIT_TILES and ng >= 2 * split)


def _unsplit(c):
    return triton.Config({**c.kwargs, "SPLIT": 1}, num_warps=c.num_warps, num_stages=c.num_stages)


def _prune(configs, named_args, **kwargs):
    """The configs whose split fits (see :func:`_fits`); where none does, the first one unsplit. Triton prunes only
    lists of two or more, so :func:`matmul` sends shapes that no split fits to :data:`gemm4s_whole`."""
    n, ng, mb = named_args["N"], named_args["KW"] // 32, named_args["MB"]
    keep = [c for c in configs if _fits(c.kwargs["SPLIT"], c.kwargs["BLOCK_N"], n, ng, mb)]
    return keep or [_unsplit(configs[0])]


@triton.heuristics({"EVEN": lambda a: a["K"] % 256 == 0})
@triton.jit
def _gemm4s(x_ptr, q_ptr, s_ptr, tab_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, K, KW, sxm, sym, MB,
           HAS_BIAS: tl.constexpr, KIND: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
           BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr):
    # MB: rows rounded up to a power of two (the autotune key); BLOCK_M = tile_rows(M), passed by the caller
    pid_n, pid_m, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = rm < M
    nmask = rn < N
    rows = tl.minimum(rn, N - 1).to(tl.int64)  # rows past N re-read row N - 1; never stored
    ng = KW // 32
    gps = tl.cdiv(ng, SPLIT)
    g_lo = pid_s * gps
    g_hi = tl.minimum(ng, g_lo + gps)
    qp = q_ptr + rows[:, None] * KW + tl.arange(0, 32)[None, :]  # [BN, 32] group 0's words
    sp = s_ptr + rows[:, None] * (KW // 4) + tl.arange(0, 8)[None, :]  # [BN, 8] group 0's block scales
    col = tl.arange(0, 256)
    xp = x_ptr + rm.to(tl.int64)[None, :] * sxm + col[:, None]  # [256, BM] x^T of group 0
    sh = (tl.arange(0, 8) * 4)[None, :, None]
    e0 = tl.where(KW > 0, 150 << 23, 0)  # see triton_q4.gemv4
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for g in range(g_lo, g_hi):
        raw = tl.load(qp + g * 32)
        sv = tl.load(sp + g * 8)
        f = (((raw[:, None, :] >> sh) & 15) | e0).to(tl.float32, bitcast=True)  # [BN, 8, 32]: 2^23 + q
        if KIND == 2:  # q4_0: (q - 8) d
            w = (f - 8388616.0) * sv.to(tl.float32)[:, :, None]
        else:  # q4c: (q - zc / 16) s, s = tab[c]
            v = sv.to(tl.int32)
            z = ((v >> 8) & 255).to(tl.float32) / 16.0
            s = tl.load(tab_ptr + (v & 255))
            w = ((f - 8388608.0) - z[:, :, None]) * s[:, :, None]
        w = tl.reshape(w, [BLOCK_N, 256])
        if EVEN:
            x = tl.load(xp + g * 256, mask=mmask[None, :], other=0.0)
        else:
            x = tl.load(xp + g * 256, mask=mmask[None, :] & (g * 256 + col < K)[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(w, x.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(w.to(x.dtype), x, acc)
    if SPLIT > 1:
        tile = pid_m * tl.num_programs(0) + pid_n
        wp = ws_ptr + rm[None, :] * N + rn[:, None]  # [BN, BM] partials of split s at wp + s * M * N
        tl.store(wp + pid_s * M * N, acc, mask=nmask[:, None] & mmask[None, :])
        done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")  # releases the partials, acquires the others'
        if done == SPLIT - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for sk in tl.static_range(SPLIT):
                acc += tl.load(wp + sk * M * N, mask=nmask[:, None] & mmask[None, :], other=0.0,
                               cache_modifier=".cg")
            _store(acc, b_ptr, y_ptr, rn, rm, nmask, mmask, sym, HAS_BIAS)
            tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call (CUDA-graph replays included)
    else:
        _store(acc, b_ptr, y_ptr, rn, rm, nmask, mmask, sym, HAS_BIAS)


_KEY = ["MB", "N", "KW", "KIND"]
gemm4s = autotune(configs=_configs(), key=_KEY, prune_configs_by={"early_config_prune": _prune},
                  do_bench=_graph_bench)(_gemm4s)
# the same kernel, never split: for shapes whose partials no workspace holds (a vocabulary-wide head at 16+ rows)
gemm4s_whole = autotune(configs=list({repr(_unsplit(c)): _unsplit(c) for c in _configs()}.values()), key=_KEY,
                        do_bench=_graph_bench)(_gemm4s)


@triton.jit
def _store(acc, b_ptr, y_ptr, rn, rm, nmask, mmask, sym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + rm.to(tl.int64)[None, :] * sym + rn[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=nmask[:, None] & mmask[None, :])


_buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K partials and per-tile counters (zero between calls) for this device and stream: kernels on one
    stream run one after another, so they share them."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _buffers:
        with torch.inference_mode(False):
            _buffers[key] = (torch.empty(SPLIT_WS_FLOATS, dtype=torch.float32, device=device),
                             torch.zeros(SPLIT_TILES, dtype=torch.int32, device=device))
    return _buffers[key]


def matmul(x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tab: torch.Tensor, kind_code: int, n: int,
           k: int, bias: torch.Tensor | None, y: torch.Tensor, ieee: bool) -> torch.Tensor:
    """``y = x2 @ W^T (+ bias)`` into ``y`` [M, N]; ``x2`` [M, K] with unit column stride."""
    m = x2.shape[0]
    ws, cnt = _split_buffers(x2.device)
    bm = tile_rows(m)
    mb = 1 << (m - 1).bit_length()
    kernel = gemm4s if _fits(2, MAX_TILE_ROWS, n, codes.shape[1] // 32, mb) else gemm4s_whole
    kernel[lambda meta: (-(-n // meta["BLOCK_N"]), -(-m // bm), meta["SPLIT"])](
        x2, codes, scales, tab, bias if bias is not None else y, y, ws, cnt, m, n, k, codes.shape[1], x2.stride(0),
        y.stride(0), mb, HAS_BIAS=bias is not None, KIND=kind_code, IEEE=ieee, BLOCK_M=bm)
    return y
