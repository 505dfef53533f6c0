"""Activation functions by their HF ``hidden_act`` names, and an ``activation`` component for flows."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from inferflow.component import Component
from inferflow.errors import SpecError
from inferflow.registry import register


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    # GPT-2's formula, written out as HF's NewGELUActivation does (same math as gelu tanh)
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_python": F.gelu,
    "gelu_new": _gelu_new,
    "gelu_tanh": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "quick_gelu": _quick_gelu,
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu2": lambda x: F.relu(x).square(),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise SpecError(None, "activation", f"unknown activation {name!r} (known: {', '.join(ACTIVATIONS)})") from None


@register("activation")
class Activation(Component):
    @dataclass(slots=True)
    class Params:
        fn: str

    def __init__(self, p: Params):
        super().__init__()
        self.fn = activation(p.fn)

    def forward(self, x, ctx=None):
        return self.fn(x)
