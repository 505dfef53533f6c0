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

    def forward(self, xs, ctx=None):
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
