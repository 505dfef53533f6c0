"""The interface every model-file loader implements."""
from __future__ import annotations

from typing import Any

import torch


class WeightSource:
    """Tensors by name plus the config that hyper-parameters are read from.

    ``kind`` selects the spec's tensor-name templates and config keys ("hf", "gguf", ...).
    ``get`` returns a CPU tensor, memory-mapped where the format allows.
    """

    kind: str = "hf"
    path: str = ""
    config: dict[str, Any]
    config_name: str = "config.json"
    arch: str | None = None

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def file_of(self, name: str) -> str:
        return self.path

    # Storage description for `inferflow inspect` (no tensor data is read); "?" / None when unknown.
    def dtype_of(self, name: str) -> str:
        return "?"

    def nbytes(self, name: str) -> int | None:
        return None

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())
