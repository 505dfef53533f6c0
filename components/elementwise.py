"""Wiring helpers for flows: residual sums and constant scaling."""
from __future__ import annotations

from dataclasses import dataclass

from inferflow.component import Component
from inferflow.registry import register


@register("add")
class Add(Component):
    """Sum of the step's inputs (a residual connection, or parallel branches)."""

    @dataclass(slots=True)
    class Params:
        pass

    def __init__(self, p: Params):
        super().__init__()

    fused_norm = None  # (rmsnorm,) when the sum's RMSNorm runs in the same kernel (inferflow/model/fuse_add_norm.py)

    def forward(self, xs, ctx=None):
        if self.fused_norm is not None:
            from inferflow.model.fuse_add_norm import run_add

            out = run_add(self, xs)
            if out is not None:
                return out
        out = xs[0]
        for x in xs[1:]:
            out = out + x
        return out


@register("scale")
class Scale(Component):
    """Multiply by a constant (Gemma's sqrt(hidden) embedding scale, MiniCPM's residual scales)."""

    @dataclass(slots=True)
    class Params:
        factor: float

    def __init__(self, p: Params):
        super().__init__()
        self.factor = p.factor

    def forward(self, x, ctx=None):
        return x * self.factor
