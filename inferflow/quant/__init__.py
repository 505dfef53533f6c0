"""Block-quantized weights: ggml block layouts (GGUF files) and the packed tensors that carry them."""
from __future__ import annotations

from .ggml import check_supported, dequantize, type_name
from .packed import PackedTensor
from . import formats  # noqa: E402  registers inferflow's own block formats with the ggml tables

__all__ = ["PackedTensor", "dequantize", "check_supported", "type_name"]
