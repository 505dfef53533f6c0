"""Dense linear layer: y = x W^T + b, with W stored [out_features, in_features] as in HF checkpoints."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferflow.component import Component
from inferflow.native import float_linear
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
        if x.is_cuda and x.dim() == 2 and x.shape[0] <= 4:
            # 1-4 rows (decode) on a GPU: a Triton GEMV where it was timed faster than cuBLAS for this shape
            from inferflow.model import gpu_gemv  # imports triton: GPU machines only

            y = gpu_gemv.linear(x, self.weight, self.bias)
            if y is not None:
                return y
        if x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= float_linear.MAX_ROWS:
            # 1-16 rows (decode steps): native kernels that stream the weight once for all rows at memory speed
            # (inferflow/native/gemv_float.c); None where they do not apply (dtype, layout, INFERFLOW_NATIVE=0)
            y = float_linear.linear(x, self.weight, self.bias)
            if y is not None:
                return y
        pk = self.__dict__.get("cpu_packed")  # (weight, oneDNN-packed copy): inferflow/model/cpu_prepack.py
        if pk is not None and x.dim() == 2 and x.shape[0] > 1 and pk[0] is self._parameters["weight"] \
                and x.dtype == pk[1].dtype and x.device.type == "cpu":
            # several rows: oneDNN's GEMM without re-laying the weight out at every call (bf16: the same bits)
            return torch.ops.mkldnn._linear_pointwise(x, pk[1], self.bias, "none", [None], "")
        if x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            # one row (a batch-1 decode step): torch's bf16 GEMM path costs ~1.5-2.5x the bf16 GEMV on x86 CPUs
            # (SmolLM2-135M shapes, 1 thread); float32 / float16 gain nothing from this, so they keep F.linear
            y = torch.mv(self.weight, x[0]).unsqueeze(0)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)
