"""Feed-forward blocks: plain (up, act, down) and gated (act(gate) * up, down) with fused or separate gate/up."""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from inferflow.component import Component
from inferflow.native import cpu_ops
from inferflow.registry import create, register

from .activations import activation


@register("mlp")
class MLP(Component):
    @dataclass(slots=True)
    class Params:
        hidden_size: int
        intermediate_size: int
        activation: str = "gelu"
        bias: bool = True
        out_bias: bool | None = None

    def __init__(self, p: Params):
        super().__init__()
        self.act = activation(p.activation)
        ob = p.bias if p.out_bias is None else p.out_bias
        self.up_proj = create("linear", {"in_features": p.hidden_size, "out_features": p.intermediate_size, "bias": p.bias})
        self.down_proj = create("linear", {"in_features": p.intermediate_size, "out_features": p.hidden_size, "bias": ob})

    def forward(self, x, ctx=None):
        return self.down_proj(self.act(self.up_proj(x)))


@register("gated_mlp")
class GatedMLP(Component):
    """SwiGLU / GeGLU. ``fused: true`` holds gate and up as one [2I, H] projection (gate rows first)."""

    @dataclass(slots=True)
    class Params:
        hidden_size: int
        intermediate_size: int
        activation: str = "silu"
        bias: bool = False
        fused: bool = False

    def __init__(self, p: Params):
        super().__init__()
        self.act, self.fused, self.inter = activation(p.activation), p.fused, p.intermediate_size
        lin = lambda i, o: create("linear", {"in_features": i, "out_features": o, "bias": p.bias})  # noqa: E731
        if p.fused:
            self.gate_up_proj = lin(p.hidden_size, 2 * p.intermediate_size)
        else:
            self.gate_proj = lin(p.hidden_size, p.intermediate_size)
            self.up_proj = lin(p.hidden_size, p.intermediate_size)
        self.down_proj = lin(p.intermediate_size, p.hidden_size)

    def fusable_projections(self):
        """gate/up read the same input: one fused GEMM after loading (inferflow/model/fuse.py)."""
        from inferflow.model.fuse import out_rows  # float or block-quantized weights alike

        rows = [out_rows(getattr(self, n, None)) for n in ("gate_proj", "up_proj")]
        if self.fused or rows != [self.inter, self.inter]:
            return []
        return [("gate_up_proj", ["gate_proj", "up_proj"], lambda _: setattr(self, "fused", True))]

    def forward(self, x, ctx=None):
        if self.fused:
            gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if gate.is_cuda and self.act is F.silu and gate.dim() == 2 and gate.stride(-1) == up.stride(-1) == 1:
            from inferflow.model import fused_ops  # silu(gate) * up in one kernel, the same roundings

            if fused_ops.ENABLED:
                return self.down_proj(fused_ops.silu_mul(gate, up))
        if self.act is F.silu and gate.device.type == "cpu" and gate.dim() == 2:
            h = cpu_ops.silu_mul(gate, up)  # one native call (inferflow/native/cpu_ops.py), float32 math
            if h is not None:
                return self.down_proj(h)
        h = self.act(gate)
        # silu returns a fresh tensor: multiply into it instead of allocating another [N, I] (same values)
        return self.down_proj(h.mul_(up) if self.act is F.silu else h * up)
