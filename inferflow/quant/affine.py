"""Asymmetric (min + scale) block formats: q2, q3, q5, q6 with a 2-byte compact header, and q4 in the exact
layout of torch's CPU int4 kernel. Layouts and measured errors: :mod:`inferflow.quant.formats` and
docs/quantization.md.

Compact header (q2, q3, q5, q6): byte 0 is a log-scale code c (s = 2 ** ((c - 192) / 12), c = 0: s = 0; range
1.6e-5 .. 38, 5.9 % apart), byte 1 a zero point z = byte / zfrac - zlo in fractions of a step; w = s * (q - z).
Two bytes instead of the usual fp16 scale + fp16 min halve the header cost (0.25 bpw at 64 weights), and the scale
search picks the codes with the header already rounded; against a float32 header the squared error grows by 16 %
(q6), 10 % (q5), 1.5 % (q3), 0.5 % (q2) (tools/quant_formats.py), less than the 0.25 bpw saved is worth.

q4: a bf16 scale s and a bf16 zero z, w = (q - 8) * s + z: the parameters torch's ``_weight_int4pack_mm_for_cpu``
takes (group 64), so the fast kernel multiplies by exactly these weights.
"""
from __future__ import annotations

from typing import Sequence

import torch

from . import search
from .bitplanes import encode_log_scale, f16_bytes, f16_field, log_scales, pack_codes, unpack_codes

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

    def __init__(self, bits: int, elems: int, zfrac: int, zlo: int, deltas: Sequence[float]):
        self.bits, self.elems, self.nmax = bits, elems, (1 << bits) - 1
        self.header, self.deltas = CompactHeader(zfrac, zlo), tuple(deltas)
        self.block_bytes = 2 + elems * bits // 8

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [n, elems] -> uint8 [n, block_bytes]."""
        cs, cz = search.affine(x, self.nmax, self.header, self.deltas)
        s = self.header.table(x.device)[cs]
        z = cz / self.header.zfrac - self.header.zlo
        q = (x / torch.where(s > 0, s, torch.ones_like(s)) + z).round_().clamp_(0, self.nmax)
        return torch.cat([cs.to(torch.uint8), cz.to(torch.uint8), pack_codes(q.to(torch.uint8), self.bits)], dim=1)

    def dequantize(self, b: torch.Tensor) -> torch.Tensor:
        """uint8 [n, block_bytes] -> float32 [n, elems]: s * (q - z)."""
        s = self.header.table(b.device)[b[:, 0].long()].unsqueeze(1)
        z = b[:, 1:2].float().div_(self.header.zfrac).sub_(self.header.zlo)
        q = unpack_codes(b[:, 2:], self.elems, self.bits).float()
        return q.sub_(z).mul_(s)


class KernelHeader:
    """bf16 scale and bf16 zero, w = (q - 8) * s + z (the int4 kernel's own convention)."""

    def fit(self, s: torch.Tensor, m: torch.Tensor) -> search.Params:
        sb = s.bfloat16().float()
        return sb, (m + 8 * sb).bfloat16().float()

    def affine(self, p: search.Params) -> tuple[torch.Tensor, torch.Tensor]:
        s, z = p
        return s, z - 8 * s


class KernelQ4:
    """q4: 64 weights = bf16 scale, bf16 zero, 32 bytes of nibbles (code j: byte 4 + j % 32, bits 4 * (j // 32))."""

    elems, bits, nmax, block_bytes = 64, 4, 15, 36

    def __init__(self, deltas: Sequence[float]):
        self.header, self.deltas = KernelHeader(), tuple(deltas)

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        s, z = search.affine(x, self.nmax, self.header, self.deltas)
        q = search.affine_codes(x, s, z - 8 * s, self.nmax)
        return torch.cat([f16_bytes(s, torch.bfloat16), f16_bytes(z, torch.bfloat16),
                          pack_codes(q.to(torch.uint8), 4)], dim=1)

    def codes_and_affine(self, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Blocks -> (codes int32 [n, 64] in 0..15, scale [n, 1], zero [n, 1]) as the int4 kernel takes them."""
        q = unpack_codes(b[:, 4:36], 64, 4).to(torch.int32)
        return q, f16_field(b, 0, torch.bfloat16), f16_field(b, 2, torch.bfloat16)

    def dequantize(self, b: torch.Tensor) -> torch.Tensor:
        q = unpack_codes(b[:, 4:36], 64, 4).float()
        return q.sub_(8).mul_(f16_field(b, 0, torch.bfloat16)).add_(f16_field(b, 2, torch.bfloat16))
