"""A memory-mapped safetensors reader with strict header checks.

Tensors are views into a private (copy-on-write) mapping of the file, so loading a model costs no
copy until the weights are converted to the target dtype or device.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass

import torch

from ..errors import FormatError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
MAX_HEADER = 100 << 20


@dataclass(slots=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse and check the header: returns tensor infos, ``__metadata__`` and the data offset."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(path, "not a safetensors file: shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or n > size - 8:
                raise FormatError(path, f"safetensors header length {n} exceeds the file ({size} bytes) or the "
                                        f"{MAX_HEADER}-byte cap")
            raw = f.read(n)
    except OSError as e:
        raise FormatError(path, f"cannot read: {e}") from None
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, bad UTF-8, over-long integers, deep nesting
        raise FormatError(path, f"safetensors header is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise FormatError(path, "safetensors header must be a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    infos: dict[str, TensorInfo] = {}
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise FormatError(path, "__metadata__ must be an object")
    spans = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
            raise FormatError(path, f"tensor {name!r}: expected an object with dtype, shape and data_offsets")
        dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise FormatError(path, f"tensor {name!r}: unsupported dtype {entry['dtype']!r} "
                                    f"(supported: {', '.join(DTYPES)})")
        shape, offs = entry["shape"], entry["data_offsets"]
        if (not isinstance(shape, list)
                or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 62 for s in shape)
                or len(shape) > 8):
            raise FormatError(path, f"tensor {name!r}: bad shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
                or not 0 <= offs[0] <= offs[1] <= data_len):
            raise FormatError(path, f"tensor {name!r}: data_offsets {offs!r} outside the data section ({data_len} bytes)")
        numel = 1
        for s in shape:
            numel *= s
        if numel * dtype.itemsize != offs[1] - offs[0]:
            raise FormatError(path, f"tensor {name!r}: shape {shape} of {entry['dtype']} needs {numel * dtype.itemsize} "
                                    f"bytes but data_offsets span {offs[1] - offs[0]}")
        infos[name] = TensorInfo(dtype, tuple(shape), data_start + offs[0], data_start + offs[1])
        if offs[1] > offs[0]:
            spans.append((offs[0], offs[1], name))
    spans.sort()
    for (a0, a1, an), (b0, b1, bn) in zip(spans, spans[1:]):
        if b0 < a1:
            raise FormatError(path, f"tensors {an!r} and {bn!r} overlap in the data section")
    return infos, {str(k): str(v) for k, v in meta.items()}, data_start


class SafetensorsFile:
    """One ``.safetensors`` file, memory-mapped on first tensor access."""

    def __init__(self, path: str):
        self.path = str(path)
        self.infos, self.metadata, self.data_start = read_header(self.path)
        self._mm: mmap.mmap | None = None

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._mm

    def get(self, name: str) -> torch.Tensor:
        info = self.infos[name]
        count = (info.end - info.start) // info.dtype.itemsize
        if count == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        flat = torch.frombuffer(self._map(), dtype=info.dtype, count=count, offset=info.start)
        return flat.view(info.shape)
