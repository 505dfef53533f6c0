"""The base class of every atomic component."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Component(nn.Module):
    """A building block named in specs.

    Subclasses define a slotted ``Params`` dataclass and ``forward(x, ctx)``. Weights are declared
    with :meth:`declare` (shape only, on the meta device); the assembler fills them from the model
    file, so nothing is allocated or randomly initialised twice.
    """

    component_name = "?"

    @staticmethod
    def declare_on(module: nn.Module, name: str, shape: tuple[int, ...]) -> None:
        module.register_parameter(name, nn.Parameter(torch.empty(tuple(int(s) for s in shape), device="meta"),
                                                     requires_grad=False))

    def declare(self, name: str, shape: tuple[int, ...]) -> None:
        """Declare a weight this component needs; the assembler loads it under ``<module path>.<name>``."""
        self.declare_on(self, name, shape)

    def forward(self, x: Any, ctx: Any) -> Any:  # pragma: no cover - every subclass overrides
        raise NotImplementedError
