"""ggml block types: sizes, names and vectorised torch dequantization.

Each dequantizer takes raw blocks as a uint8 tensor [n_blocks, block_bytes] and returns float32
[n_blocks, block_elems]. The arithmetic mirrors gguf-py's reference (``gguf.quants``) operation by
operation (same products, same order, no fused multiply-adds), so results are bit-identical in float32.
Layouts: ggml-common.h; formulas: ggml-quants.c (see docs/formats.md).
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import FormatError

# id -> (name, elements per block, bytes per block); ids as in ggml.h / gguf-py constants.py
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30
# Plain element types read as ordinary tensors (no blocks).
PLAIN_DTYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16, 24: torch.int8, 25: torch.int16,
                26: torch.int32, 27: torch.int64, 28: torch.float64}


# Block types that are not ggml's (inferflow's own formats, ids >= 4096: quant/formats.py), registered with
# :func:`register_type`: id -> (name, elements, bytes). Kept apart so GGML_TYPES stays exactly ggml's (a GGUF
# file naming one of these ids is still refused as an unknown ggml type).
EXTRA_TYPES: dict[int, tuple[str, int, int]] = {}


def type_name(qtype: int) -> str:
    if qtype in EXTRA_TYPES:
        return EXTRA_TYPES[qtype][0]
    return GGML_TYPES[qtype][0] if qtype in GGML_TYPES else f"unknown ggml type {qtype}"


def block_size(qtype: int) -> tuple[int, int]:
    """(elements, bytes) of one block."""
    _, elems, nbytes = EXTRA_TYPES[qtype] if qtype in EXTRA_TYPES else GGML_TYPES[qtype]
    return elems, nbytes


def _u8(*vals: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.uint8, device=device).view(shape)


# Byte fields are made contiguous before any bit operation: torch's uint8 kernels are ~10x slower
# on the strided [n, k] column slices of a block array than on a compact copy of the slice.
def _field(b: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    return b[:, start:stop].contiguous()


def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """The fp16 field at byte ``off`` of each block, as float32 [n, 1]."""
    return _field(b, off, off + 2).view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32]: low nibbles are elements 0-15, high nibbles 16-31."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian u32 -> [n, 32] bits (bit j is element j's fifth bit)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device).view(1, 1, 8)
    return ((qh[:, :, None] >> shifts) & 1).reshape(qh.shape[0], 32)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(_field(b, 2, 18)).view(torch.int8) - 8  # exact in int8, cheaper than in float
    return q.float().mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    # in place on the fresh float tensor: the same operations in the same order as d * q + m, one buffer
    return _nibbles(_field(b, 4, 20)).float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_nibbles(_field(b, 6, 22)) | (_high_bits(_field(b, 2, 6)) << 4)).view(torch.int8) - 16
    return q.float().mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(_field(b, 8, 24)) | (_high_bits(_field(b, 4, 8)) << 4)
    return q.float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _field(b, 2, 34).view(torch.int8).float().mul_(_f16(b, 0))


IQ4_NL = 20
# IQ4_NL's 16 non-uniform levels (ggml-common.h kvalues_iq4nl)
_IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    # llama.cpp's fallback for k-quant tensors whose rows are not multiples of 256: fp16 d, 16 bytes of nibbles
    # (element j < 16: low nibble of byte j, element 16 + j: its high nibble) indexing the level table
    qs = _field(b, 2, 18)
    idx = torch.cat([qs & 0x0F, qs >> 4], dim=1).long()
    return _f16(b, 0) * torch.tensor(_IQ4_NL_VALUES, dtype=torch.float32, device=b.device)[idx]


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n, dev = b.shape[0], b.device
    scales = _field(b, 0, 16)
    dl = (_f16(b, 80) * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).view(n, 16, 1)
    q = (_field(b, 16, 80).view(n, 2, 1, 32) >> _u8(0, 2, 4, 6, shape=(1, 1, 4, 1), device=dev)) & 3
    return (dl * q.view(n, 16, 16).float() - ml).view(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n, dev = b.shape[0], b.device
    sc = _field(b, 96, 108)
    low = (sc[:, :8].reshape(n, 1, 8) >> _u8(0, 4, shape=(1, 2, 1), device=dev)).reshape(n, 16)
    high = (sc[:, 8:12].reshape(n, 1, 4) >> _u8(0, 2, 4, 6, shape=(1, 4, 1), device=dev)).reshape(n, 16)
    scales = (((low & 0x0F) | ((high & 3) << 4)).view(torch.int8) - 32).float()
    dl = (_f16(b, 108) * scales).view(n, 16, 1)
    ql = (_field(b, 32, 96).view(n, 2, 1, 32) >> _u8(0, 2, 4, 6, shape=(1, 1, 4, 1), device=dev)).view(n, 16, 16) & 3
    shifts = torch.arange(8, dtype=torch.uint8, device=dev).view(1, 1, 8, 1)
    qh = (_field(b, 0, 32).view(n, 1, 1, 32) >> shifts).view(n, 16, 16) & 1
    # the high bit *clear* means "subtract 4" (ggml's hmask convention)
    q = ql.view(torch.int8) - ((qh ^ 1) << 2).view(torch.int8)
    return (dl * q.float()).view(n, 256)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins (as float32)."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc.float(), mn.float()


def _k4_common(b: torch.Tensor, nibbles_at: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K share their layout head: fp16 d and dmin, 6-bit scales/mins, 128 bytes of low nibbles."""
    n, dev = b.shape[0], b.device
    sc, mn = _scale_min_k4(_field(b, 4, 16))
    d = (_f16(b, 0) * sc).view(n, 8, 1)
    dm = (_f16(b, 2) * mn).view(n, 8, 1)
    low = _field(b, nibbles_at, nibbles_at + 128).view(n, 4, 1, 32)
    q = ((low >> _u8(0, 4, shape=(1, 1, 2, 1), device=dev)) & 0x0F).view(n, 8, 32)
    return d, dm, q


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    d, dm, q = _k4_common(b, 16)
    return (d * q.float() - dm).view(b.shape[0], 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n, dev = b.shape[0], b.device
    d, dm, ql = _k4_common(b, 48)
    shifts = torch.arange(8, dtype=torch.uint8, device=dev).view(1, 1, 8, 1)
    qh = ((_field(b, 16, 48).view(n, 1, 1, 32) >> shifts) & 1).view(n, 8, 32)
    return (d * (ql | (qh << 4)).float() - dm).view(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n, dev = b.shape[0], b.device
    d = (_f16(b, 208) * _field(b, 192, 208).view(torch.int8).float()).view(n, 16, 1)
    ql = ((_field(b, 0, 128).view(n, 2, 1, 64) >> _u8(0, 4, shape=(1, 1, 2, 1), device=dev)) & 0x0F).view(n, 8, 32)
    qh = ((_field(b, 128, 192).view(n, 2, 1, 32) >> _u8(0, 2, 4, 6, shape=(1, 1, 4, 1), device=dev)) & 3).view(n, 8, 32)
    q = (ql | (qh << 4)).view(torch.int8) - 32
    return (d * q.view(n, 16, 16).float()).view(n, 256)


def _bf16(b: torch.Tensor) -> torch.Tensor:
    # integer shift keeps every bit (NaN payloads too), as gguf-py does
    return (b.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


DEQUANTIZERS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    Q4_0: _q4_0, Q4_1: _q4_1, Q5_0: _q5_0, Q5_1: _q5_1, Q8_0: _q8_0,
    Q2_K: _q2_k, Q3_K: _q3_k, Q4_K: _q4_k, Q5_K: _q5_k, Q6_K: _q6_k, IQ4_NL: _iq4_nl,
}
SUPPORTED = {F32, F16, BF16, *DEQUANTIZERS}


def register_type(qtype: int, name: str, elems: int, nbytes: int,
                  dequantizer: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Add a block type that is not ggml's (see EXTRA_TYPES) to the tables every packed-weight path reads, so
    PackedTensor, packed linears and row lookups decode it unchanged."""
    if qtype in GGML_TYPES or EXTRA_TYPES.get(qtype, (name, elems, nbytes)) != (name, elems, nbytes):
        raise ValueError(f"block type id {qtype} is already {type_name(qtype)}")
    EXTRA_TYPES[qtype] = (name, elems, nbytes)
    DEQUANTIZERS[qtype] = dequantizer


def check_supported(qtype: int, tensor: str | None = None, file: str | None = None) -> None:
    """Refuse (FormatError naming the type and the tensor) a block type we cannot dequantize."""
    if qtype not in SUPPORTED and qtype not in EXTRA_TYPES:
        names = ", ".join(type_name(t) for t in sorted(SUPPORTED))
        where = f"tensor {tensor!r}: " if tensor else ""
        raise FormatError(file, f"{where}ggml type {type_name(qtype)} is not supported (supported: {names})")


def dequantize(data: torch.Tensor, qtype: int, shape: tuple[int, ...] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Raw ggml bytes (uint8, any shape whose rows are whole blocks) -> ``shape`` in ``dtype``.

    Computed in float32 (bit-exact vs gguf-py), then cast: one transient float32 copy per call.
    """
    check_supported(qtype)
    if qtype in (F32, F16):
        out = data.contiguous().view(PLAIN_DTYPES[qtype]).float()
    elif qtype == BF16:
        out = _bf16(data.reshape(-1))
    else:
        _, nbytes = block_size(qtype)
        out = DEQUANTIZERS[qtype](data.reshape(-1, nbytes))
    if shape is None:
        shape = (*data.shape[:-1], -1)
    return out.reshape(shape).to(dtype)
