"""Asymmetric (min + scale) block formats with a 2-byte compact header: q6, q5, q3 and q2 over 64/32-weight
blocks, and q4 over 32-weight blocks (4.5 bpw, the size of llama.cpp's Q4_0). Layouts and measured errors:
:mod:`inferflow.quant.formats` and docs/quantization.md.

Compact header: byte 0 is a log-scale code c (s = 2 ** ((c - 192) / 12), c = 0: s = 0; range 1.6e-5 .. 38, 5.9 %
apart), byte 1 a zero point z = byte / zfrac - zlo in fractions of a step; w = s * (q - z). Two bytes instead of the
usual fp16 scale + fp16 min halve the header cost, and the scale search picks the codes with the header already
rounded; against a float32 header the squared error grows by 18 % (q6), 11 % (q5), 7 % (q4), 2 % (q3), 1 % (q2)
on MiniLM (tools/quant_formats.py), less than the saved bits are worth.

q4 spends those two bytes on 32-weight blocks: asymmetric codes over half the block of the earlier bf16-header
64-weight layout cut MiniLM's squared error by 25 % at the same 4.5 bpw. Its codes and affine map onto torch's
CPU int4 kernel (group 32, scale and zero rounded to bf16 there): :meth:`CompactAffine.codes_and_affine`.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import search
from .bitplanes import encode_log_scale, log_scales, pack_codes, unpack_codes

SCALE_BIAS, SCALE_STEPS = 192, 12


class CompactHeader:
    """Byte 0: log-scale code; byte 1: zero point z = code / zfrac - zlo (see module doc)."""

    def __init__(self, zfrac: int, zlo: int):
        self.zfrac, self.zlo = zfrac, zlo

    def table(self, device: torch.device) -> torch.Tensor:
        return log_scales(256, SCALE_BIAS, SCALE_STEPS, device)

    def fit(self, s: torch.Tensor, m: torch.Tensor) -> search.Params:
        cs = encode_log_scale(s, 256, SCALE_BIAS, SCALE_STEPS)
        sq = self.table(s.device)[cs]
        z = -m / torch.where(sq > 0, sq, torch.ones_like(sq))
        cz = ((z + self.zlo) * self.zfrac).round_().clamp_(0, 255)
        return cs, cz

    def affine(self, p: search.Params) -> tuple[torch.Tensor, torch.Tensor]:
        cs, cz = p
        s = self.table(cs.device)[cs]
        return s, -s * (cz / self.zfrac - self.zlo)


class CompactAffine:
    """A compact-header asymmetric format of ``bits`` bits per code over blocks of ``elems`` weights."""

    def __init__(self, bits: int, elems: int, zfrac: int, zlo: int, deltas: Sequence[float],
                 weight: str = "uniform"):
        self.bits, self.elems, self.nmax, self.weight = bits, elems, (1 << bits) - 1, weight
        self.header, self.deltas = CompactHeader(zfrac, zlo), tuple(deltas)
        self.block_bytes = 2 + elems * bits // 8

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [n, elems] -> uint8 [n, block_bytes]."""
        cs, cz = search.affine(x, self.nmax, self.header, self.deltas, self.weight)
        s = self.header.table(x.device)[cs]
        z = cz / self.header.zfrac - self.header.zlo
        q = (x / torch.where(s > 0, s, torch.ones_like(s)) + z).round_().clamp_(0, self.nmax)
        return torch.cat([cs.to(torch.uint8), cz.to(torch.uint8), pack_codes(q.to(torch.uint8), self.bits)], dim=1)

    def _sz(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.header.table(b.device)[b[:, 0].long()].unsqueeze(1)
        return s, b[:, 1:2].float().div_(self.header.zfrac).sub_(self.header.zlo)

    def codes_and_affine(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Blocks of codes up to 4 bits -> (codes int32 [n, elems], scale [n, 1], zero [n, 1]) in the int4 kernel's
        convention w = (q' - 8) * scale + zero. The kernel rounds scale and zero to bf16, and a zero's rounding error
        shifts a whole block, so codes narrower than 4 bits are shifted, q' = q + c, to keep the zero small:
        zero = s * (8 - c - z), |8 - c - z| <= 4 (q2: 0.5)."""
        assert self.bits <= 4
        s, z = self._sz(b)
        c = (8 - z).round_().clamp_(0, 15 - self.nmax)
        q = unpack_codes(b[:, 2:], self.elems, self.bits).to(torch.int32) + c.to(torch.int32)
        return q, s, s * (8 - c - z)

    def int4_parts(self) -> list:
        """5/6-bit codes as two int4-kernel parts whose weights sum to s * (lo + 16 hi - z): with z = 16 a + r
        (r < 16), part one is s * (lo - r) over the low 4-bit plane (zero s * (8 - r), small), part two 16 s * (hi - a)
        with codes hi - a + 8 and zero 0 (exact)."""
        assert self.bits in (5, 6)
        lo_bytes, hi_bits = self.elems // 2, self.bits - 4

        def split(b: torch.Tensor):
            s, z = self._sz(b)
            a = (z / 16).floor_()
            return s, a, z - 16 * a

        def low(b: torch.Tensor):
            s, _, r = split(b)
            return unpack_codes(b[:, 2:2 + lo_bytes], self.elems, 4).to(torch.int32), s, s * (8 - r)

        def high(b: torch.Tensor):
            s, a, _ = split(b)
            q = unpack_codes(b[:, 2 + lo_bytes:], self.elems, hi_bits).to(torch.int32) + (8 - a).to(torch.int32)
            return q, 16 * s, torch.zeros_like(s)

        return [low, high]

    def dequantize(self, b: torch.Tensor) -> torch.Tensor:
        """uint8 [n, block_bytes] -> float32 [n, elems]: s * (q - z)."""
        s = self.header.table(b.device)[b[:, 0].long()].unsqueeze(1)
        z = b[:, 1:2].float().div_(self.header.zfrac).sub_(self.header.zlo)
        q = unpack_codes(b[:, 2:], self.elems, self.bits).float()
        return q.sub_(z).mul_(s)
