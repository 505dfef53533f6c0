"""Structure-of-arrays repacking of the Triton kernels' weight blocks, cached per weight, and the matmul over it.

The on-disk blocks (quant/triton_kernels.py's table: 18 or 34 bytes, not 4-byte aligned) make a GPU gather single
bytes. At first use each weight is repacked once, with the same bits per weight:

    codes   q4 (q4c, q4_0): int32 [N, K / 8], code of column 8 * w + i at bits 4 * i of word w
            q8_0:           int8  [N, K]
    scales  [N, K / 32], 16 bits per block: fp16 d (q8_0, q4_0), or q4c's header bytes as one int16
            (low byte: log-scale index c, high byte: zero zc)

4 + 16/32 = 4.5 and 8 + 16/32 = 8.5 bits per weight, as the blocks. The cache is keyed by the blocks tensor (its
data pointer, shape, type) and holds a weak reference to it: the repacking is freed with the blocks, and a new
tensor reusing a freed address is repacked afresh. The blocks stay held (state dicts, moves off the GPU and the
bit-exact reference path read them), so a weight on this path holds both forms on the GPU.

Rows up to :data:`GEMV_MAX_ROWS` run a GEMV kernel that reads the weight once for all rows; more rows (prefill)
decode the weight into a reused per-thread buffer of the activations' dtype and run one cuBLAS matmul.
"""
from __future__ import annotations

import threading
import weakref

import torch

GEMV_MAX_ROWS = 16
FMA_MAX_ROWS = 2            # up to here: float32 FMA GEMV; above: tl.dot with rows padded to 16
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
    codes = torch.cat([nib & 15, nib >> 4], dim=-1).reshape(n, k // 2, 2)  # [N, K/2, 2] in column order
    packed = (codes[..., 0] | (codes[..., 1] << 4)).contiguous()  # uint8 [N, K/2]: two columns a byte
    return packed.view(torch.int32), scales  # little-endian: column 8w + i at bits 4i of word w


def soa(blocks: torch.Tensor, kind: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached repacking of ``blocks`` (made at the first call for this tensor)."""
    key = (blocks.data_ptr(), tuple(blocks.shape), kind, tuple(shape), blocks.device)
    hit = _cache.get(key)
    if hit is not None and hit[0]() is blocks:
        return hit[1]
    with torch.inference_mode(False), torch.no_grad():
        packed = repack(blocks, kind, shape)
    with _lock:
        _cache[key] = (weakref.ref(blocks), packed)
    weakref.finalize(blocks, _drop, key, id(packed))
    return packed


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
    if m > GEMV_MAX_ROWS:
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
