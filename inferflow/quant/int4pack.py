"""ggml 4-bit blocks repacked for torch's CPU int4 weight-only matmul (``_weight_int4pack_mm_for_cpu``).

The kernel computes ``y = x @ W^T`` with ``W[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]`` for 4-bit codes
``q`` and one (scale, zero) pair per 32 inputs (group ``g = k // 32``). Three ggml types map onto it exactly
(the codes are the file's own nibbles; only the per-group affine is rewritten):

    Q4_0  w = d * (q - 8)                     scale = d          zero = 0
    Q4_1  w = d * q + m                       scale = d          zero = m + 8 d
    Q4_K  w = (d sc_j) q - (dmin m_j)         scale = d sc_j     zero = 8 d sc_j - dmin m_j  (sub-block j of 32)

Memory: 4 bits of code + 2 bf16 (scale, zero) per 32 weights = 5.0 bits per weight (Q4_0's 4.5 grows by the zero;
Q4_1 stays 5.0, Q4_K's 4.5 becomes 5.0). The kernel is fast only with bf16 activations and bf16 scales (fp32
activations take its scalar path, 20-50x slower), so results are within bf16 tolerance of the exact dequantized
product, not bit-exact: x, scale and zero are rounded to bf16 and the output comes back in bf16 (measured relative
error in tests/test_cpu_kernels.py and tools/bench_quant_linear.py).

The packed byte layout is the kernel's own and depends on the CPU build (AVX-512 packs 64 rows per block, AVX2 32).
The large-batch paths (:func:`dequantize_t`, :func:`matmul_dequantized`) and :func:`unpack_codes` invert it; the
layout is chosen by packing a probe at first use and checking which known layout reproduces it, so an unknown
layout disables only that inverse (the kernel itself is always fed through torch's own packer).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from . import ggml

GROUP = 32
TYPES = (ggml.Q4_0, ggml.Q4_1, ggml.Q4_K)
# Other block types that map onto the kernel (inferflow's q4, q3, q2; parts for q6, q5, q3.5: quant/formats.py):
# qtype -> (group, blocks [n, bytes] -> (codes int32 [n, elems], scale [n, elems/group], zero [n, elems/group]))
_EXTRA: dict[int, tuple[int, Callable]] = {}
# Rows repacked per call at load: a multiple of every layout's row block (64, 32), so the packed chunks
# concatenate into the packing of the whole matrix; bounds the transient int32 code matrix (~9 MiB at K = 576).
_PACK_ROWS = 4096


def available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


# Types whose weight is a SUM of int4 parts (codes wider than 4 bits split into 4-bit planes: q5, q6, Q8_0):
# qtype -> the ids of its parts in _EXTRA (qtype | k << PART_SHIFT). :func:`pack` concatenates the parts along K
# and the caller repeats x as many times, so ONE kernel call sums them (1.1-1.4x faster than a call per part, or
# than concatenating along N and adding halves: Q8_0 at the default model's shapes, 1 thread).
_PARTS: dict[int, tuple[int, ...]] = {}
PART_SHIFT = 24


def register(qtype: int, group: int, codes_and_affine: Callable) -> None:
    """Let blocks of ``qtype`` run through the kernel (see ``_EXTRA``); group: 32, 64, 128 or 256."""
    _EXTRA[qtype] = (group, codes_and_affine)


def register_parts(qtype: int, group: int, parts: "list[Callable]") -> None:
    """Blocks of ``qtype`` whose weight is the sum of several 4-bit (codes, scale, zero) parts, one kernel call
    each (e.g. a 6-bit code = low 4 bits + 16 x high 2 bits)."""
    ids = tuple(qtype | (k << PART_SHIFT) for k in range(len(parts)))
    for pid, fn in zip(ids, parts):
        _EXTRA[pid] = (group, fn)
    _PARTS[qtype] = ids


def parts_of(qtype: int) -> tuple[int, ...]:
    """The part ids :func:`pack` takes for ``qtype`` (the type itself when it maps onto one kernel call)."""
    return _PARTS.get(qtype, (qtype,))


def group_of(qtype: int) -> int:
    qtype = parts_of(qtype)[0]
    return _EXTRA[qtype][0] if qtype in _EXTRA else GROUP


def supports(qtype: int, shape: tuple[int, ...]) -> bool:
    """True when a 2-D weight of this type and shape can be repacked (the kernel needs N % 16 == 0)."""
    return (qtype in TYPES or qtype in _EXTRA or qtype in _PARTS) and len(shape) == 2 and shape[0] % 16 == 0 \
        and shape[1] % group_of(qtype) == 0 and available()


def _codes_and_affine(blocks: torch.Tensor, qtype: int, rows: int, cols: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw blocks of ``rows`` rows -> (codes int32 [rows, cols] in 0..15, scale and zero float32 [rows, cols/32])."""
    _, nbytes = ggml.block_size(qtype & ((1 << PART_SHIFT) - 1))
    b = blocks.reshape(-1, nbytes)
    if qtype in _EXTRA:
        group, fn = _EXTRA[qtype]
        q, scale, zero = fn(b)
        g = cols // group
        return q.reshape(rows, cols), scale.reshape(rows, g), zero.reshape(rows, g)
    if qtype == ggml.Q4_K:
        n = b.shape[0]
        sc, mn = ggml._scale_min_k4(ggml._field(b, 4, 16))
        scale = ggml._f16(b, 0) * sc                           # [n, 8]: d * sc_j, as the dequantizer forms it
        zero = 8 * scale - ggml._f16(b, 2) * mn                 # 8 d sc_j - dmin m_j
        low = ggml._field(b, 16, 144).view(n, 4, 1, 32)
        q = (low >> ggml._u8(0, 4, shape=(1, 1, 2, 1), device=b.device)) & 0x0F  # sub-block 2c low, 2c+1 high
    else:
        off = 2 if qtype == ggml.Q4_0 else 4
        q = ggml._nibbles(ggml._field(b, off, off + 16))
        scale = ggml._f16(b, 0)
        zero = torch.zeros_like(scale) if qtype == ggml.Q4_0 else ggml._f16(b, 2) + 8 * scale
    g = cols // GROUP
    return q.reshape(rows, cols).to(torch.int32), scale.reshape(rows, g), zero.reshape(rows, g)


def pack(blocks: torch.Tensor, qtype: int | tuple[int, ...], shape: tuple[int, int]
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml blocks of a [N, K] weight -> (kernel-packed codes uint8 [N, K/2], scale_and_zero bf16 [K/32, N, 2]).
    A tuple of P part ids (:func:`parts_of`) packs the parts side by side along K: [N, P K/2] and [P K/32, N, 2],
    the weight of ``x.repeat(1, P)``."""
    rows, cols = shape
    blocks = blocks.reshape(rows, -1)
    ids = qtype if isinstance(qtype, tuple) else (qtype,)
    packed, affine = [], []
    for r in range(0, rows, _PACK_ROWS):
        n = min(_PACK_ROWS, rows - r)
        q, s, z = (torch.cat(v, dim=1) for v in zip(*(_codes_and_affine(blocks[r:r + n], i, n, cols) for i in ids)))
        packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1))
        affine.append(torch.stack([s, z], dim=-1))
    sz = torch.cat(affine, dim=0).transpose(0, 1).to(torch.bfloat16).contiguous()
    return torch.cat(packed, dim=0), sz


def matmul(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` through the kernel: x [..., K] in any float dtype -> [..., N] in x's dtype (computed in bf16)."""
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, packed, x2.shape[1] // sz.shape[0], sz)
    return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])


# ---- the inverse of the kernel's byte layout ----------------------------------------------------------------
# (block rows, how a full block pairs its rows): "halves" puts row r and row r + block/2 in one byte (AVX-512,
# AVX2 builds), "pairs" rows 2i and 2i + 1 (scalar builds, and every build's partial last block). Within a
# block the bytes run over k first: [K, block/2], low nibble = the first row of the pair. So each block unpacks
# to its transposed codes [K, block] in natural row order with one interleave: no transpose is ever copied.
_LAYOUTS = ((64, "halves"), (32, "halves"), (32, "pairs"))


def _blocks_t(packed: torch.Tensor, rows: int, cols: int, layout: tuple[int, str]) -> list[torch.Tensor]:
    """Transposed codes, uint8 [n_blocks, K, block] for the whole row blocks and [1, K, tail] for a partial one."""
    block, scheme = layout
    flat = packed.reshape(-1)
    full, tail = divmod(rows, block)
    parts = []
    if full:
        b = flat[:full * block * cols // 2].view(full, cols, block // 2)
        parts.append(torch.stack([b & 0x0F, b >> 4], dim=2 if scheme == "halves" else 3).view(full, cols, block))
    if tail:
        b = flat[full * block * cols // 2:].view(1, cols, tail // 2)
        parts.append(torch.stack([b & 0x0F, b >> 4], dim=3).view(1, cols, tail))
    return parts


@functools.lru_cache(maxsize=None)
def _layout() -> tuple[int, str] | None:
    """The layout this build's packer uses, found by packing a probe with whole and partial blocks of each size."""
    if not available():
        return None
    gen = torch.Generator().manual_seed(0)
    probe = torch.randint(0, 16, (112, 64), dtype=torch.int32, generator=gen)  # 112 = 64 + 48 = 3 * 32 + 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    for layout in _LAYOUTS:
        codes = torch.cat([p.transpose(1, 2).reshape(-1, 64) for p in _blocks_t(packed, 112, 64, layout)])
        if torch.equal(codes.to(torch.int32), probe):
            return layout
    return None


def can_unpack() -> bool:
    return _layout() is not None


def _layout_or_raise() -> tuple[int, str]:
    layout = _layout()
    if layout is None:
        raise RuntimeError("this torch build packs int4 weights in an unknown layout")
    return layout


def unpack_codes(packed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Kernel-packed codes -> uint8 [rows, cols] in 0..15 (any device)."""
    parts = _blocks_t(packed, rows, cols, _layout_or_raise())
    return torch.cat([p.transpose(1, 2).reshape(-1, cols) for p in parts])


def _weight_t(codes_t: torch.Tensor, sz: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[nb, K, B] codes of the rows ``sz`` covers -> W^T blocks q * scale + (zero - 8 scale), in float32 (one
    fused multiply-add pass; the kernel's (q - 8) * scale + zero up to float32 rounding), cast to dtype."""
    nb, cols, width = codes_t.shape
    g = sz.shape[0]  # groups per row: the group size is cols // g (32 for ggml types, 64 for inferflow's q4)
    s, z = sz.float().view(g, nb, width, 2).permute(1, 0, 2, 3).unbind(-1)  # [nb, G, B] each
    z = z - 8 * s
    w = codes_t.view(nb, g, cols // g, width).float()
    torch.addcmul(z[:, :, None], w, s[:, :, None], out=w)
    return w.view(nb, cols, width).to(dtype)


def dequantize(packed: torch.Tensor, sz: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] the kernel multiplies by, (q - 8) * scale + zero in float32, then cast to dtype."""
    rows, cols = shape
    out, r = [], 0
    for codes_t in _blocks_t(packed, rows, cols, _layout_or_raise()):
        n = codes_t.shape[0] * codes_t.shape[2]
        out.append(_weight_t(codes_t, sz[:, r:r + n], dtype).transpose(1, 2).reshape(n, cols))
        r += n
    return torch.cat(out)


def matmul_dequantized(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, shape: tuple[int, int],
                       chunk_elems: int) -> torch.Tensor:
    """``x2 @ W^T`` for many rows of x [M, K] (prefill), where the kernel's cost per row exceeds one decode of W:
    W decoded ``chunk_elems`` at a time into bf16 (the kernel's own precision, and bf16 GEMMs are the fast
    ones at large M), each chunk multiplied at once. Returns x's dtype."""
    rows, cols = shape
    block = _layout_or_raise()[0]
    step = max(block, chunk_elems // cols // block * block)
    xb = x.to(torch.bfloat16)
    y = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    for r0 in range(0, rows, step):
        n0 = min(step, rows - r0)
        r = r0
        for codes_t in _blocks_t(packed[r0:r0 + n0], n0, cols, _layout_or_raise()):
            nb, _, width = codes_t.shape
            part = torch.matmul(xb, _weight_t(codes_t, sz[:, r:r + nb * width], torch.bfloat16))  # [nb, M, B]
            y[:, r:r + nb * width] = part.permute(1, 0, 2).reshape(x.shape[0], nb * width)
            r += nb * width
    return y


def can_transpose(rows: int) -> bool:
    """True when :func:`dequantize_t` handles a weight of ``rows`` rows on this build (whole "halves" blocks)."""
    layout = _layout()
    return layout is not None and layout[1] == "halves" and rows % layout[0] == 0


def dequantize_t(packed: torch.Tensor, sz: torch.Tensor, shape: tuple[int, int], out: torch.Tensor) -> torch.Tensor:
    """W^T [K, N] written into ``out`` (bf16 [K, N]): q * scale + (zero - 8 scale), rounded once to bf16.

    Faster than :func:`dequantize` + a transpose (prefill: 2-4x at the default model's shapes, 1 thread): the
    nibbles go straight from the kernel's packed block order into their transposed bf16 slots (two strided
    writes), and the affine is one broadcast pass whose operands are contiguous along N (vectorized; the
    row-major form broadcasts along runs of 32 and measured 2-7x slower). The result is a plain row-major
    [K, N] matrix: ``x @ out`` is one GEMM (bf16, AMX where the CPU has it). Needs :func:`can_transpose`."""
    rows, cols = shape
    block = _layout_or_raise()[0]
    nb, half = rows // block, block // 2
    b = packed.view(nb, cols, half)
    v = out.view(cols, nb, 2, half).transpose(0, 1)          # [nb, K, 2, B/2]: byte (blk, k, i) -> two rows
    v[:, :, 0].copy_(b & 0x0F)
    v[:, :, 1].copy_(b >> 4)
    g = sz.shape[0]
    s = sz[:, :, 0].float()
    z = (sz[:, :, 1].float() - 8 * s).to(out.dtype).unsqueeze(1)   # [G, 1, N]
    w = out.view(g, cols // g, rows)
    torch.addcmul(z, w, s.to(out.dtype).unsqueeze(1), out=w)
    return out


# ---- Q8_0 (and inferflow's q8, the same blocks) as two int4 parts ----------------------------------------------
# q = 16 h + l with h = q >> 4 in -8..7 (arithmetic shift) and l = q & 15 in 0..15, so d q = 16 d h + d l:
#   high part  codes h + 8, scale 16 d, zero 0     ->  (h + 8 - 8) 16 d            = 16 d h   (exact affine)
#   low part   codes l,     scale d,    zero 8 d   ->  (l - 8) d + 8 d             = d l
# The codes are exact; bf16 rounds only 16 d, d and 8 d (relative 2^-9 each, as q5/q6's planes). Memory: two
# planes of 4-bit codes + bf16 (scale, zero) per 32 = 10 bits per weight (the blocks' 8.5 are dropped).
def _q8_0_split(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = ggml._field(b, 2, 34).view(torch.int8).to(torch.int32)
    return q, ggml._f16(b, 0)


def _q8_0_low(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, d = _q8_0_split(b)
    return q & 0x0F, d, 8 * d


def _q8_0_high(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, d = _q8_0_split(b)
    return (q >> 4) + 8, 16 * d, torch.zeros_like(d)


register_parts(ggml.Q8_0, GROUP, [_q8_0_low, _q8_0_high])
