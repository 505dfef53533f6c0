"""Normalisations: LayerNorm (with or without bias) and RMSNorm (incl. Gemma's (1 + w) form)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferflow.component import Component
from inferflow.native import cpu_ops
from inferflow.registry import register


@register("layernorm")
class LayerNorm(Component):
    @dataclass(slots=True)
    class Params:
        dim: int
        eps: float = 1e-5
        bias: bool = True

    def __init__(self, p: Params):
        super().__init__()
        self.dim, self.eps = p.dim, p.eps
        self.declare("weight", (p.dim,))
        if p.bias:
            self.declare("bias", (p.dim,))
        else:
            self.bias = None

    def forward(self, x, ctx=None):
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)


@register("rmsnorm")
class RMSNorm(Component):
    """x / rms(x) * (offset + w), computed in float32 (``offset: 1`` is Gemma's (1 + w) variant)."""

    @dataclass(slots=True)
    class Params:
        dim: int
        eps: float = 1e-6
        offset: float = 0.0
        # HF llama casts back to the input dtype before the weight multiply; Gemma multiplies in float32
        weight_in_float: bool = False

    def __init__(self, p: Params):
        super().__init__()
        self.dim, self.eps, self.offset, self.weight_in_float = p.dim, p.eps, p.offset, p.weight_in_float
        self.declare("weight", (p.dim,))

    def forward(self, x, ctx=None):
        if "fused_pending" in self.__dict__:  # the add before computed this norm of its sum (fuse_add_norm.py)
            from inferflow.model.fuse_add_norm import take

            y = take(self, x)
            if y is not None:
                return y
        if x.is_cuda:  # one kernel, the same roundings (inferflow/model/fused_ops.py)
            from inferflow.model import fused_ops

            if fused_ops.ENABLED:
                y = fused_ops.rmsnorm(x, self.weight, self.eps, self.offset, self.weight_in_float)
                if y is not None:
                    return y
        dtype = x.dtype
        if x.device.type == "cpu":  # one native call, bit for bit the arithmetic below (inferflow/native/cpu_ops.py)
            y = cpu_ops.rmsnorm(x, self.weight, self.eps, self.offset, self.weight_in_float)
            if y is not None:
                return y
        if x.device.type == "cpu" and not self.offset:
            # torch's rms_norm: one call instead of five ops, on the CPU bit for bit the float32 arithmetic below
            if dtype == torch.float32 and self.weight.dtype == dtype:
                return F.rms_norm(x, (self.dim,), self.weight, self.eps)
            h = F.rms_norm(x.float(), (self.dim,), None, self.eps)
            if self.weight_in_float:
                return (h * self.weight.float()).to(dtype)
            return self.weight.to(dtype) * h.to(dtype)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float() + self.offset if self.offset else self.weight
        if self.weight_in_float:
            return (h * w.float()).to(dtype)
        return w.to(dtype) * h.to(dtype)
