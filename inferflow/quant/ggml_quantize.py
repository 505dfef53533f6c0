"""Quantizers for llama.cpp's legacy block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), in torch.

Each mirrors gguf-py's reference (``gguf.quants``, itself bit-exact with ggml-quants.c) operation by operation in
float32: same divisions, same truncations, same fp16 rounding, so the blocks are byte-identical to
``gguf.quants.quantize`` (tests/test_quant_formats.py checks it). Input float32 [n, 32], output uint8 [n, bytes].
Decoding is :mod:`inferflow.quant.ggml`'s. Also here: inferflow's q8, which stores Q8_0 blocks but searches the
scale (a few clip factors and a least-squares refit) instead of taking max|x| / 127.
"""
from __future__ import annotations

import torch

from . import search
from .bitplanes import f16_bytes


def _inv(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _signed_extreme(b: torch.Tensor) -> torch.Tensor:
    return b.gather(1, b.abs().argmax(1, keepdim=True))  # first index of the largest |x|, as numpy's argmax


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [n, 32] -> [n, 16]: element j in the low nibble, element j + 16 in the high one."""
    return (q[:, :16] & 0x0F) | (q[:, 16:] << 4)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of 32 codes as a little-endian u32 (np.packbits(..., bitorder="little")) -> uint8 [n, 4]."""
    bits = ((q >> 4) & 1).view(-1, 4, 8)
    return (bits << torch.arange(8, dtype=torch.uint8, device=q.device)).sum(2, dtype=torch.uint8)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """gguf-py's np_roundf: round half away from zero, computed the same way."""
    a = x.abs()
    fl = a.floor()
    return torch.sign(x) * (fl + (2 * (a - fl)).floor())


def q8_0(b: torch.Tensor) -> torch.Tensor:
    d = b.abs().amax(1, keepdim=True) / 127
    qs = _roundf(b * _inv(d))
    return torch.cat([f16_bytes(d), qs.to(torch.int8).view(torch.uint8)], dim=1)


def q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _signed_extreme(b) / -8
    q = torch.trunc(b * _inv(d) + 8.5).to(torch.uint8).clamp_(0, 15)
    return torch.cat([f16_bytes(d), _nibbles(q)], dim=1)


def q4_1(b: torch.Tensor) -> torch.Tensor:
    mx, mn = b.amax(1, keepdim=True), b.amin(1, keepdim=True)
    d = (mx - mn) / 15
    q = torch.trunc((b - mn) * _inv(d) + 0.5).to(torch.uint8).clamp_(0, 15)
    return torch.cat([f16_bytes(d), f16_bytes(mn), _nibbles(q)], dim=1)


def q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _signed_extreme(b) / -16
    q = torch.trunc(b * _inv(d) + 16.5).to(torch.uint8).clamp_(0, 31)
    return torch.cat([f16_bytes(d), _high_bits(q), _nibbles(q)], dim=1)


def q5_1(b: torch.Tensor) -> torch.Tensor:
    mx, mn = b.amax(1, keepdim=True), b.amin(1, keepdim=True)
    d = (mx - mn) / 31
    q = torch.trunc((b - mn) * _inv(d) + 0.5).to(torch.uint8).clamp_(0, 31)
    return torch.cat([f16_bytes(d), f16_bytes(mn), _high_bits(q), _nibbles(q)], dim=1)


class _F16Scale:
    def fit(self, s: torch.Tensor) -> search.Params:
        return (s.half().float(),)

    def scale(self, p: search.Params) -> torch.Tensor:
        return p[0]


def q8_searched(b: torch.Tensor) -> torch.Tensor:
    """inferflow q8: Q8_0 blocks whose fp16 scale is searched (codes -128..127)."""
    grid = search.UniformGrid(-128, 127)
    (d,) = search.signed(b, grid, _F16Scale(), (1.0, 0.995, 0.99, 0.98), both_ends=False)
    q = grid.codes(b / torch.where(d != 0, d, torch.ones_like(d)))
    return torch.cat([f16_bytes(d), q.to(torch.int8).view(torch.uint8)], dim=1)
