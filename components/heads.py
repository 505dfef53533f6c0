"""Output-side components: soft-capping of final logits and pooling for sentence embeddings."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from inferflow.component import Component
from inferflow.registry import register


@register("softcap")
class SoftCap(Component):
    """cap * tanh(x / cap) (Gemma 2's final logits)."""

    @dataclass(slots=True)
    class Params:
        cap: float

    def __init__(self, p: Params):
        super().__init__()
        self.cap = p.cap

    def forward(self, x, ctx=None):
        return torch.tanh(x / self.cap) * self.cap


@register("bias")
class Bias(Component):
    """Adds a learned vector (BART's final_logits_bias, BERT's MLM decoder bias)."""

    @dataclass(slots=True)
    class Params:
        dim: int

    def __init__(self, p: Params):
        super().__init__()
        self.declare("weight", (p.dim,))

    def forward(self, x, ctx=None):
        return x + self.weight
