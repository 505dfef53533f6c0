"""Kernel choices timed at an engine's warm-up, kept on disk so that the next start does not time them again.

The GPU GEMV selection (model/gpu_gemv.py) and the 4-bit kernel selection (quant/cuda_q4.py) time every candidate
for each (rows, shape, dtype) key in CUDA graphs before the decode graphs are captured. On an H200 that timing was
1.5 s of a warm restart of a Qwen3-8B-shaped bf16 engine (8.0 s, 3.0 s of it warm-up and capture;
docs/benchmarks.md), and more for a 4-bit one, every start, for the same answers.

A store is one JSON file per GPU under ``$INFERFLOW_CACHE_DIR/choices/`` (the native build cache's root), named by
a hash of everything a choice depends on: the GPU's name and compute capability, the torch, CUDA and Triton
versions, and the bytes of the source files that define the candidates. Anything else changes nothing a choice
could depend on, and any of these changes starts a new file. Entries map the key (as text) to the choice (JSON).
The callers check a choice read back against their reference result on its first use (one call) and only skip
its timing. ``INFERFLOW_CHOICE_CACHE=0`` turns the stores off.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Sequence

import torch

from . import cache_dir

log = logging.getLogger(__name__)
MISSING = object()


def enabled() -> bool:
    return os.environ.get("INFERFLOW_CHOICE_CACHE", "1") != "0"


class ChoiceStore:
    """Persistent choices of one selection (``name``) whose candidates ``sources`` define, per CUDA device."""

    def __init__(self, name: str, sources: Sequence[Path]):
        self.name, self.sources = name, tuple(sources)
        self._files: dict[int, Path | None] = {}   # device index -> its file (None: off or no hash)
        self._data: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def _file(self, device: torch.device) -> Path | None:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._files:
            self._files[idx] = None
            try:
                self._files[idx] = cache_dir().parent / "choices" / f"{self.name}-{self._stamp(idx)}.json"
            except Exception as e:  # noqa: BLE001 - no store is only slower
                log.warning("%s choices: no persistent store (%s: %s)", self.name, type(e).__name__, e)
        return self._files[idx]

    def _stamp(self, idx: int) -> str:
        try:
            import triton

            tv = triton.__version__
        except ImportError:
            tv = "-"
        h = hashlib.sha256(json.dumps([torch.cuda.get_device_name(idx), torch.cuda.get_device_capability(idx),
                                       torch.__version__, torch.version.cuda, tv]).encode())
        for p in self.sources:
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        return h.hexdigest()[:20]

    def _entries(self, device: torch.device) -> tuple[Path | None, dict[str, Any]]:
        f = self._file(device)
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._data:
            self._data[idx] = self._read(f) if f is not None else {}
        return f, self._data[idx]

    @staticmethod
    def _read(f: Path) -> dict[str, Any]:
        try:
            data = json.loads(f.read_text())
            return data if isinstance(data, dict) else {}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:  # a damaged file: timed again and rewritten
            log.warning("choice store %s unreadable (%s); ignoring it", f, e)
            return {}

    def get(self, key: Sequence[Any], device: torch.device) -> Any:
        """The stored choice for ``key`` on ``device``, or MISSING."""
        if not enabled() or device.type != "cuda":
            return MISSING
        with self._lock:
            return self._entries(device)[1].get(repr(tuple(key)), MISSING)

    def put(self, key: Sequence[Any], device: torch.device, value: Any) -> None:
        """Store ``value`` (JSON-serialisable) for ``key``: merged into the file as it is now, replaced atomically."""
        if not enabled() or device.type != "cuda":
            return
        with self._lock:
            f, data = self._entries(device)
            data[repr(tuple(key))] = value
            if f is None:
                return
            try:
                f.parent.mkdir(parents=True, exist_ok=True)
                merged = {**self._read(f), **data}  # another process's entries since we read it
                fd, tmp = tempfile.mkstemp(dir=f.parent, prefix=f.name, suffix=".tmp")
                with os.fdopen(fd, "w") as out:
                    json.dump(merged, out, indent=0, sort_keys=True)
                os.replace(tmp, f)
            except OSError as e:  # a read-only cache: choices are timed at every start, as before
                log.warning("choice store %s not written (%s); not trying again in this process", f, e)
                self._files[device.index if device.index is not None else torch.cuda.current_device()] = None
