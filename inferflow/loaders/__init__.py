"""Model-file loaders. Each returns a :class:`~inferflow.loaders.source.WeightSource`."""
from __future__ import annotations

from pathlib import Path

from ..errors import FormatError
from .source import WeightSource


def open_file(path: Path) -> WeightSource:
    """Open a single model file by its content (magic bytes), not only its name."""
    from .hf import HFDirSource

    if path.suffix == ".safetensors" or path.name == "config.json":
        return HFDirSource(path.parent)
    raise FormatError(str(path), "unrecognised model file (supported here: HF folders with safetensors)")
