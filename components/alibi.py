"""ALiBi: a per-head linear bias on key distance (BLOOM, MPT, Falcon-RW)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from inferflow.component import Component
from inferflow.registry import register


def bloom_slopes(n: int, max_bias: float = 8.0) -> torch.Tensor:
    closest = 2 ** math.floor(math.log2(n))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)) * max_bias / 8.0)
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != n:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)) * max_bias / 8.0)
        slopes += [extra ** (i + 1) for i in range(0, 2 * (n - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def mpt_slopes(n: int, max_bias: float = 8.0) -> torch.Tensor:
    p2 = 2 ** math.ceil(math.log2(n))
    m = torch.arange(1, p2 + 1, dtype=torch.float32) * (max_bias / p2)
    slopes = 1.0 / torch.pow(2, m)
    if p2 != n:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n]
    return slopes


@register("alibi")
class ALiBi(Component):
    @dataclass(slots=True)
    class Params:
        num_heads: int
        style: str = "bloom"     # slope schedule for non-power-of-two head counts: "bloom" or "mpt"
        max_bias: float = 8.0
        scale: float = 1.0       # Falcon adds ALiBi before the 1/sqrt(d) scaling
        # Falcon builds slope * key_position in bfloat16; rounding is not shift-invariant, so with a dtype the
        # bias uses absolute key positions as it does (the same softmax as relative ALiBi for causal attention)
        dtype: str | None = None

    def __init__(self, p: Params):
        super().__init__()
        fn = {"bloom": bloom_slopes, "mpt": mpt_slopes}[p.style]
        self.raw_slopes = fn(p.num_heads, p.max_bias)
        self.slopes = self.raw_slopes * p.scale
        self.scale = p.scale
        self.dtype = getattr(torch, p.dtype) if p.dtype else None

    def bias_fn(self, ctx, causal: bool):
        slopes = self.slopes
        if self.dtype is not None:
            if not causal:
                raise ValueError("alibi: dtype (absolute key positions) needs causal attention")
            low = self.raw_slopes.to(self.dtype)

            def rounded(qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
                b = (low.to(ki.device)[:, None] * ki[None, :]).float() * self.scale
                return b[:, None, :].expand(-1, qi.shape[0], -1)

            return rounded

        def bias(qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
            rel = (ki[None, :] - qi[:, None]).float()
            if not causal:
                rel = -rel.abs()
            return slopes.to(qi.device)[:, None, None] * rel[None]

        return bias

    def forward(self, x, ctx=None):  # pragma: no cover - used through bias_fn()
        return x
