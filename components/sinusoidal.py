"""Fixed sinusoidal position embeddings (Transformer, fairseq/M2M100 layouts)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from inferflow.component import Component
from inferflow.registry import register


@register("sinusoidal_positions")
class SinusoidalPositions(Component):
    @dataclass(slots=True)
    class Params:
        dim: int
        style: str = "halves"    # "halves": [sin | cos] (fairseq, M2M100); "interleaved": sin/cos pairs (Vaswani)
        offset: int = 0          # fairseq starts at padding_idx + 1
        base: float = 10000.0

    def __init__(self, p: Params):
        super().__init__()
        self.p = p

    def forward(self, positions, ctx=None):
        half = self.p.dim // 2
        pos = (positions + self.p.offset).float()[:, None]
        if self.p.style == "halves":
            freq = torch.exp(torch.arange(half, dtype=torch.float32, device=pos.device)
                             * -(math.log(self.p.base) / (half - 1)))
            ang = pos * freq[None]
            out = torch.cat([ang.sin(), ang.cos()], dim=-1)
        else:
            freq = torch.exp(torch.arange(0, self.p.dim, 2, dtype=torch.float32, device=pos.device)
                             * -(math.log(self.p.base) / self.p.dim))
            ang = pos * freq[None]
            out = torch.stack([ang.sin(), ang.cos()], dim=-1).flatten(-2)
        if out.shape[-1] < self.p.dim:
            out = torch.nn.functional.pad(out, (0, 1))
        return out
