"""Dense linear layer: y = x W^T + b, with W stored [out_features, in_features] as in HF checkpoints."""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from inferflow.component import Component
from inferflow.quant.cpu_kernels import hold_linear, linear as packed_linear
from inferflow.registry import register


@register("linear")
class Linear(Component):
    @dataclass(slots=True)
    class Params:
        in_features: int
        out_features: int
        bias: bool = False

    packed = None  # {"weight": (ggml type, shape)} when the weight is held as GGUF blocks

    def __init__(self, p: Params):
        super().__init__()
        self.in_features, self.out_features = p.in_features, p.out_features
        self.declare("weight", (p.out_features, p.in_features))
        if p.bias:
            self.declare("bias", (p.out_features,))
        else:
            self.bias = None

    def load_packed(self, name, t, dtype) -> bool:
        """Keep a block-quantized weight packed (as blocks, or repacked for a fast kernel: quant/cpu_kernels.py)."""
        if name != "weight":
            return False
        hold_linear(self, name, t)
        return True

    def forward(self, x, ctx=None):
        if self.packed is not None:
            return packed_linear(self, "weight", x, self.bias)
        return F.linear(x, self.weight, self.bias)
