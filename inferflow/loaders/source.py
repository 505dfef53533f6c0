"""The interface every model-file loader implements."""
from __future__ import annotations

import mmap
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

    def mapped(self) -> list[mmap.mmap]:
        """The file mappings the tensors of ``get`` view (a loader keeps them in ``_mm``, or in the ``_mm`` of the
        ``files`` it reads): once a model holds copies of its weights, the engine drops their pages
        (model/hugepages.py)."""
        found = [getattr(self, "_mm", None)]
        found += [getattr(f, "_mm", None) for f in (getattr(self, "files", None) or {}).values()]
        return [m for m in found if isinstance(m, mmap.mmap) and not m.closed]
