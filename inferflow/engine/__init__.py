"""The serving engine: continuous batching over a paged, prefix-cached KV cache, with the full sampling suite."""
from __future__ import annotations

from .config import EngineConfig
from .engine import Engine, Overloaded
from .fill_mask import FillMaskOutput, MaskPrediction
from .handle import RequestHandle
from .outputs import CompletionOutput, EmbeddingOutput, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "EmbeddingOutput",
           "Overloaded", "RequestHandle", "FillMaskOutput", "MaskPrediction"]
