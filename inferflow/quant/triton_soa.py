"""Structure-of-arrays repacking of the Triton kernels' weight blocks, cached per weight, and the matmul over it.

The on-disk blocks (quant/triton_kernels.py's table: 18 or 34 bytes, not 4-byte aligned) make a GPU gather single
bytes. At first use each weight is repacked once, with the same bits per weight:

    codes   q4 (q4c, q4_0): int32 [N, KP / 8], KP = K padded to whole groups of 256 columns (8 blocks); nibble i
            (bits 4i..4i+3) of word j of group g is column 256 g + 32 i + j: nibble i of a group's 32 words is
            block 8 g + i (quant/triton_q4.py decodes a nibble slab per scale, without shuffles)
            q8_0:           int8  [N, K]
    scales  [N, KP / 32] (q8_0: K / 32), 16 bits per block: fp16 d (q8_0, q4_0), or q4c's header bytes as one
            int16 (low byte: log-scale index c, high byte: zero zc); padding blocks are zero

4 + 16/32 = 4.5 and 8 + 16/32 = 8.5 bits per weight, as the blocks (plus the padding when K % 256 != 0). The cache
is keyed by the blocks tensor (its data pointer, shape, type) and holds a weak reference to it: the repacking is
freed with the blocks, and a new tensor reusing a freed address is repacked afresh. The blocks stay held (state
dicts, moves off the GPU and the bit-exact reference path read them), so a weight on this path holds both forms.

4-bit weights: up to :data:`FMA_MAX_ROWS` activation rows run the float32 FMA GEMV (triton_q4.gemv4), up to
:data:`GEMM_MAX_ROWS` a dequant-fused ``tl.dot`` GEMM (triton_q4_gemm.gemm4, or triton_q4_swap.gemm4s for
:data:`SWAP_ROWS` rows: no decoded copy), more rows (prefills, mixed steps) decode the weight into a reused
per-thread buffer and run one cuBLAS matmul. Inside CUDA graphs, 65 rows and up take whichever of these two, the
rows in chunks of CUDA_MAX_ROWS, or (Hopper) the warpgroup-MMA GEMM of quant/cuda_q4.py, quant/q4_wide.py timed
fastest. Up to
:data:`CUDA_MAX_ROWS`, the CUDA kernels of quant/cuda_q4.py run instead where they timed faster. q8_0: GEMV kernels
(triton_gemv.py) up to :data:`GEMV_MAX_ROWS`, the decode + cuBLAS path above.
"""
from __future__ import annotations

import os
import threading
import weakref
from typing import Callable

import torch

from . import cuda_q4, q4_wide

GEMV_MAX_ROWS = 16
# 4-bit: the fused tl.dot GEMMs up to here; above, decode + cuBLAS. On an H200 (Qwen3-8B shapes, 2026-12-01) decode
# + cuBLAS took 1.3-2.1x less GPU time per layer at 96-256 rows, yet eager prefill steps of 96-256 tokens, bound by
# the host, took 0.86-0.97x the time fused (one launch per matmul, not two): tools/bench_q4_prefill_gpu.py
GEMM_MAX_ROWS = 256
FMA_MAX_ROWS = 2            # up to here: float32 FMA GEMV; above: tl.dot with rows padded to 16
CUDA_MAX_ROWS = 64          # up to here the CUDA kernels (quant/cuda_q4.py) are timed against those two
SWAP_ROWS = (3, 32)         # 16-bit activations: the swapped GEMM (triton_q4_swap.py), 1.2-1.3x gemm4 per layer
DEQUANT_TILE = (32, 256)    # (BLOCK_N, BLOCK_K) of the dequantization kernel
DEQUANT_MAX_ELEMS = 1 << 26  # prefill decodes at most this many weights at once (a vocabulary head: row chunks)
_CODE = {"q4c": 0, "q8_0": 1, "q4_0": 2}

_cache: dict[tuple, tuple] = {}
_lock = threading.Lock()


def repack(blocks: torch.Tensor, kind: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of ``blocks`` (uint8 [N, row_bytes]) in the SoA layout above, on the blocks' device."""
    n, k = shape
    g = k // 32
    b = blocks.reshape(n, g, 34 if kind == "q8_0" else 18)
    head = b[:, :, :2].contiguous()  # [N, G, 2]: fp16 d, or q4c's (c, zc)
    scales = head.view(torch.int16 if kind == "q4c" else torch.float16).reshape(n, g)
    if kind == "q8_0":
        return b[:, :, 2:].contiguous().view(torch.int8).reshape(n, k), scales
    nib = b[:, :, 2:]  # [N, G, 16]: code j at byte j % 16, bits 4 * (j // 16)
    codes = torch.cat([nib & 15, nib >> 4], dim=-1)  # [N, G, 32] in column order
    gp = -(-g // 8) * 8  # whole groups of 8 blocks; zero codes and scales pad the last one
    if gp != g:
        codes = torch.cat([codes, codes.new_zeros(n, gp - g, 32)], dim=1)
        scales = torch.cat([scales, scales.new_zeros(n, gp - g)], dim=1)
    c = codes.reshape(n, gp // 8, 8, 32).transpose(2, 3)  # [N, groups, word j, nibble i]
    packed = (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()  # byte b of a word: nibbles 2b, 2b + 1
    return packed.view(torch.int32).reshape(n, gp * 4), scales.contiguous()  # little-endian: nibble i at bits 4i


def soa(blocks: torch.Tensor, kind: str, shape: tuple[int, int],
        make: Callable[[torch.Tensor, str, tuple[int, int]], tuple] = repack) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached repacking of ``blocks`` by ``make`` (this module's layout unless told; made at the first call
    for this tensor, freed with it)."""
    key = _key(blocks, kind, shape, make)
    hit = _cache.get(key)
    if hit is not None and hit[0]() is blocks:
        return hit[1]
    with torch.inference_mode(False), torch.no_grad():
        packed = make(blocks, kind, shape)
    with _lock:
        _cache[key] = (weakref.ref(blocks), packed)
    weakref.finalize(blocks, _drop, key, id(packed))
    return packed


def _key(blocks: torch.Tensor, kind: str, shape: tuple[int, int], make: Callable) -> tuple:
    # the maker by module and name: two layouts' ``repack`` functions must not share an entry
    return (blocks.data_ptr(), tuple(blocks.shape), kind, tuple(shape), blocks.device,
            f"{make.__module__}.{make.__qualname__}")


def cached(blocks: torch.Tensor, kind: str, shape: tuple[int, int], make: Callable = repack) -> tuple | None:
    """The cached repacking of ``blocks`` by ``make``, or None (never made here)."""
    hit = _cache.get(_key(blocks, kind, shape, make))
    return hit[1] if hit is not None and hit[0]() is blocks else None


def forget(blocks: torch.Tensor, kind: str, shape: tuple[int, int], make: Callable = repack) -> None:
    """Drop the cached repacking of ``blocks`` by ``make`` (a layout that lost its timing: its memory back)."""
    with _lock:
        _cache.pop(_key(blocks, kind, shape, make), None)


def _drop(key: tuple, ident: int) -> None:
    with _lock:
        hit = _cache.get(key)
        if hit is not None and id(hit[1]) == ident:
            del _cache[key]


_local = threading.local()


def _weight_buffer(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This thread's reused decode buffer for (shape, dtype, device): a prefill allocates no weight-sized tensor."""
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    key = (tuple(shape), dtype, device)
    if key not in bufs:
        with torch.inference_mode(False):
            bufs[key] = torch.empty(shape, dtype=dtype, device=device)
    return bufs[key]


def dequantize(codes: torch.Tensor, scales: torch.Tensor, tab: torch.Tensor, kind: str, shape: tuple[int, int],
               dtype: torch.dtype, interpreted: bool) -> torch.Tensor:
    """The weight [N, K] decoded into a reused buffer of ``dtype`` (float32 decode, then one rounding)."""
    from . import triton_gemv as tg

    n, k = shape
    # the interpreter has no bf16/fp16 stores worth trusting: it decodes to float32 and torch casts
    out = _weight_buffer(shape, torch.float32 if interpreted else dtype, codes.device)
    if kind != "q8_0":
        from . import triton_q4_gemm as triton_q4

        bn, bg = (32, 2) if not interpreted else (16, 1)
        grid = (triton_cdiv(n, bn), triton_cdiv(codes.shape[1] // 32, bg))
        triton_q4.dequant4[grid](codes, scales, tab, out, n, k, codes.shape[1], KIND=_CODE[kind], BLOCK_N=bn, BG=bg)
        return out if out.dtype == dtype else out.to(dtype)
    bn, bk = DEQUANT_TILE if not interpreted else (16, 64)
    grid = (triton_cdiv(n, bn), triton_cdiv(k, bk))
    tg.dequant[grid](codes, scales, tab, out, n, k, KIND=_CODE[kind], BLOCK_N=bn, BLOCK_K=bk)
    return out if out.dtype == dtype else out.to(dtype)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def matmul(x2: torch.Tensor, blocks: torch.Tensor, kind: str, shape: tuple[int, int], tab: torch.Tensor,
           bias: torch.Tensor | None, interpreted: bool) -> torch.Tensor:
    """``F.linear(x2, W, bias)`` for 2-D contiguous-row activations ``x2`` [M, K]; returns [M, N] in x2's dtype."""
    from . import triton_gemv as tg

    n, k = shape
    m = x2.shape[0]
    codes, scales = soa(blocks, kind, shape)
    if kind != "q8_0" and m <= GEMM_MAX_ROWS:
        if m <= CUDA_MAX_ROWS or interpreted:
            return _matmul4(x2, blocks, codes, scales, tab, kind, shape, bias, interpreted)
        calls = wide_calls(x2, blocks, codes, scales, tab, kind, shape, bias)
        return calls[q4_wide.pick(x2, n, k, kind, bias, calls)]()
    if m > GEMV_MAX_ROWS:
        return _decoded(x2, codes, scales, tab, kind, shape, bias, interpreted)
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    b = bias if bias is not None else y  # any pointer: unused without HAS_BIAS
    grid = lambda meta: (triton_cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    if m <= FMA_MAX_ROWS:
        tg.gemv_fma[grid](x2, codes, scales, tab, b, y, m, n, k, x2.stride(0), y.stride(0),
                          HAS_BIAS=bias is not None, KIND=_CODE[kind], MP=1 if m == 1 else 2)
    else:
        tg.gemv_dot[grid](x2, codes, scales, tab, b, y, m, n, k, x2.stride(0), y.stride(0),
                          HAS_BIAS=bias is not None, KIND=_CODE[kind], IEEE=x2.dtype == torch.float32 or interpreted)
    return y


def wide_calls(x2: torch.Tensor, blocks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tab: torch.Tensor,
               kind: str, shape: tuple[int, int], bias: torch.Tensor | None) -> dict[str, Callable[[], torch.Tensor]]:
    """quant/q4_wide.py's candidates for a 4-bit matmul of more than CUDA_MAX_ROWS rows on a GPU, by name; WGMMA
    where the warpgroup-MMA GEMM takes these rows (quant/cuda_q4.py times its configs against the fused GEMM; its
    ``nvcc`` build waits for the first call: an eager step, which takes the fused GEMM, makes none)."""
    calls = {q4_wide.FUSED: lambda: _matmul4(x2, blocks, codes, scales, tab, kind, shape, bias, False),
             q4_wide.DECODE: lambda: _decoded(x2, codes, scales, tab, kind, shape, bias, False),
             q4_wide.CHUNKS: lambda: torch.cat([_matmul4(x2[r:r + CUDA_MAX_ROWS], blocks, codes, scales, tab, kind,
                                                         shape, bias, False)
                                                for r in range(0, x2.shape[0], CUDA_MAX_ROWS)])}
    if cuda_q4.wide_supports(x2, kind, bias, build=False):
        calls[q4_wide.WGMMA] = lambda: _matmul4(x2, blocks, codes, scales, tab, kind, shape, bias, False, wide=True)
    return calls


def _decoded(x2: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tab: torch.Tensor, kind: str,
             shape: tuple[int, int], bias: torch.Tensor | None, interpreted: bool) -> torch.Tensor:
    """The weight decoded into this thread's reused buffer, then one cuBLAS matmul (prefills, and where
    quant/q4_wide.py timed it faster inside CUDA graphs)."""
    n, k = shape
    m = x2.shape[0]
    rows = max(1, min(n, DEQUANT_MAX_ELEMS // k))
    if rows < n:  # a vocabulary-sized weight: row chunks, each decoded into the buffer and used at once
        yt = torch.empty(n, m, dtype=x2.dtype, device=x2.device)  # transposed: a chunk is a row slab
        for r in range(0, n, rows):
            c = min(rows, n - r)
            w = dequantize(codes[r:r + c], scales[r:r + c], tab, kind, (c, k), x2.dtype, interpreted)
            torch.mm(w, x2.t(), out=yt[r:r + c])
        y = yt.t().contiguous()
        return y.add_(bias.to(y.dtype)) if bias is not None else y
    w = dequantize(codes, scales, tab, kind, shape, x2.dtype, interpreted)
    return torch.addmm(bias.to(x2.dtype), x2, w.t()) if bias is not None else torch.mm(x2, w.t())


def _matmul4(x2: torch.Tensor, blocks: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, tab: torch.Tensor,
             kind: str, shape: tuple[int, int], bias: torch.Tensor | None, interpreted: bool,
             wide: bool = False) -> torch.Tensor:
    """4-bit weights, up to GEMM_MAX_ROWS rows: the FMA GEMV or the dequant-fused tl.dot GEMM (triton_q4*.py), or
    the CUDA kernel timed faster for the key: up to CUDA_MAX_ROWS rows, or (``wide``) up to the warpgroup-MMA
    GEMM's."""
    from . import triton_q4 as t4
    from . import triton_q4_gemm as t4g
    from . import triton_q4_swap as t4s

    n, k = shape
    m, kw = x2.shape[0], codes.shape[1]
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    b = bias if bias is not None else y  # any pointer: unused without HAS_BIAS
    if m == 0:
        return y

    def triton_call() -> torch.Tensor:
        if m <= FMA_MAX_ROWS:
            ws, cnt = _split_buffers(x2.device)
            t4.gemv4[lambda meta: (triton_cdiv(n, meta["BLOCK_N"]), meta["SPLIT"])](
                x2, codes, scales, tab, b, y, ws, cnt, n, k, kw, x2.stride(0), y.stride(0),
                HAS_BIAS=bias is not None, KIND=_CODE[kind], MP=m)
            return y
        if swapped(x2, interpreted):
            return t4s.matmul(x2, codes, scales, tab, _CODE[kind], n, k, bias, y, interpreted)
        mb = 1 << (m - 1).bit_length()  # the autotune key: rows rounded up to a power of two
        t4g.gemm4[lambda meta: (triton_cdiv(n, meta["BLOCK_N"]), triton_cdiv(m, meta["BLOCK_M"]))](
            x2, codes, scales, tab, b, y, m, n, k, kw, x2.stride(0), y.stride(0), mb, HAS_BIAS=bias is not None,
            KIND=_CODE[kind], IEEE=x2.dtype == torch.float32 or interpreted)
        return y

    if not interpreted and (cuda_q4.wide_supports(x2, kind, bias) if wide
                            else m <= CUDA_MAX_ROWS and cuda_q4.supports(x2, kind, bias)):
        baseline = "gemv4" if m <= FMA_MAX_ROWS else "gemm4s" if swapped(x2, False) else "gemm4"
        choice = cuda_q4.choose(x2, blocks, codes, scales, tab, kind, n, k, bias, triton_call, baseline)
        if choice[0] != cuda_q4.TRITON:
            out = cuda_q4.run(choice, x2, blocks, codes, scales, tab, kind, n, k, bias, y)
            if out is not None:
                return out
    return triton_call()


def swapped(x2: torch.Tensor, interpreted: bool) -> bool:
    """Whether Triton's 4-bit GEMM for these activations is the swapped one (triton_q4_swap.py): for
    :data:`SWAP_ROWS` rows of bf16/fp16 on Hopper or later (float32 only under the interpreter, whose products are
    IEEE), unless ``$INFERFLOW_Q4_SWAP`` is 0 (read at each call, so that an A/B run can capture one engine with
    each)."""
    if os.environ.get("INFERFLOW_Q4_SWAP", "1") in ("0", "false", "off"):
        return False
    if not SWAP_ROWS[0] <= x2.shape[0] <= SWAP_ROWS[1]:
        return False
    if interpreted:
        return True
    # Hopper and later only: measured there, and built for the warpgroup MMA's 64-row M side
    return x2.dtype != torch.float32 and torch.cuda.get_device_capability(x2.device)[0] >= 9


_split: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K GEMV's float32 partial sums and per-tile counters (zero between calls: the kernel resets them)
    for this device and stream: kernels on one stream run one after another, so they can share them."""
    from . import triton_q4 as t4

    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _split:
        with torch.inference_mode(False):
            _split[key] = (torch.empty(t4.SPLIT_MAX * 2 * t4.SPLIT_MAX_N, dtype=torch.float32, device=device),
                           torch.zeros(t4.SPLIT_MAX_N, dtype=torch.int32, device=device))
    return _split[key]
