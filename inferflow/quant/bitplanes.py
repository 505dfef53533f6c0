"""Byte-level building blocks of inferflow's block formats: bit planes, 2-byte float fields, log-scale tables.

A **b-bit plane** (b in 1, 2, 4, 8) stores the n codes of a block in n*b/8 bytes, strided the way ggml stores
nibbles: code j lives in byte ``j % m`` (m = n*b/8) at bit ``b * (j // m)``. Unpacking is one broadcast shift, a
mask and a reshape (no gather), and codes wider than one plane split into planes that follow each other in the
block, low bits first: 3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2 bits.

**Log scales**: a scale code c (c > 0) means ``2 ** ((c - bias) / steps)``; c = 0 means a zero scale. The table is
built from 24 fixed float32 mantissas (2 ** (r / 24), frozen as hex literals) and exact power-of-two scaling, so
every platform decodes bit-identical scales (no libm ``exp2`` in the decode path).
"""
from __future__ import annotations

import functools
import math

import torch

_PLANES = {1: (1,), 2: (2,), 3: (2, 1), 4: (4,), 5: (4, 1), 6: (4, 2), 8: (8,)}

# float32(2 ** (r / 24)) for r = 0..23 (the 12-step table is every other entry)
_MANTISSAS_24 = tuple(float.fromhex(h) for h in (
    "0x1.000000p+0", "0x1.07805ap+0", "0x1.0f38fap+0", "0x1.172b84p+0", "0x1.1f59acp+0", "0x1.27c532p+0",
    "0x1.306fe0p+0", "0x1.395b92p+0", "0x1.428a30p+0", "0x1.4bfdaep+0", "0x1.55b810p+0", "0x1.5fbb6ep+0",
    "0x1.6a09e6p+0", "0x1.74a5b0p+0", "0x1.7f910ep+0", "0x1.8ace54p+0", "0x1.965feap+0", "0x1.a24848p+0",
    "0x1.ae89fap+0", "0x1.bb279cp+0", "0x1.c823e0p+0", "0x1.d5818ep+0", "0x1.e3437ep+0", "0x1.f16ca2p+0"))


def plane_bytes(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits take (all planes)."""
    return n * bits // 8


def pack_plane(codes: torch.Tensor, b: int) -> torch.Tensor:
    """uint8 codes [nb, n] (values < 2**b) -> one b-bit plane, uint8 [nb, n*b/8]."""
    nb, n = codes.shape
    per = 8 // b
    c = codes.reshape(nb, per, n // per)  # c[:, t, i] is code t*m + i
    out = c[:, 0].clone()
    for t in range(1, per):
        out |= c[:, t] << (b * t)
    return out


def unpack_plane(plane: torch.Tensor, b: int) -> torch.Tensor:
    """One b-bit plane uint8 [nb, m] -> codes uint8 [nb, m*8/b]."""
    if b == 8:
        return plane
    shifts = torch.arange(0, 8, b, dtype=torch.uint8, device=plane.device).view(1, -1, 1)
    return ((plane.unsqueeze(1) >> shifts) & ((1 << b) - 1)).reshape(plane.shape[0], -1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [nb, n] of ``bits`` bits -> their planes, low bits first, uint8 [nb, n*bits/8]."""
    parts, shift = [], 0
    for b in _PLANES[bits]:
        parts.append(pack_plane((codes >> shift) & ((1 << b) - 1), b))
        shift += b
    return torch.cat(parts, dim=1)


def unpack_codes(data: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The planes of ``n`` codes (uint8 [nb, n*bits/8], contiguous) -> uint8 codes [nb, n]."""
    out, shift, at = None, 0, 0
    for b in _PLANES[bits]:
        m = n * b // 8
        part = unpack_plane(data[:, at:at + m].contiguous(), b)
        out = part if out is None else out | (part << shift)
        shift += b
        at += m
    return out


def f16_field(b: torch.Tensor, off: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The 2-byte float (fp16 or bf16) at byte ``off`` of each block -> float32 [nb, 1]."""
    return b[:, off:off + 2].contiguous().view(dtype).float()


def f16_bytes(x: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """float32 [nb, 1] -> its 2-byte encoding (fp16 or bf16, round to nearest even), uint8 [nb, 2]."""
    return x.to(dtype).contiguous().view(torch.uint8).reshape(-1, 2)


@functools.lru_cache(maxsize=None)
def _log_table(codes: int, bias: int, steps: int) -> torch.Tensor:
    step = 24 // steps
    vals = [0.0] + [math.ldexp(_MANTISSAS_24[((c - bias) % steps) * step], (c - bias) // steps)
                    for c in range(1, codes)]
    return torch.tensor(vals, dtype=torch.float32)


def log_scales(codes: int, bias: int, steps: int, device: torch.device | None = None) -> torch.Tensor:
    """float32 [codes]: entry c is 2 ** ((c - bias) / steps), entry 0 is 0 (``steps`` divides 24)."""
    t = _log_table(codes, bias, steps)
    return t if device is None or t.device == device else t.to(device)


def encode_log_scale(s: torch.Tensor, codes: int, bias: int, steps: int) -> torch.Tensor:
    """Positive scales -> the nearest code in log space, clamped to 1..codes-1 (0 for s <= 0), int64."""
    c = torch.round(torch.log2(s.clamp_min(1e-38)) * steps + bias).clamp_(1, codes - 1).long()
    return torch.where(s > 0, c, torch.zeros_like(c))
