"""GGUF model files (llama.cpp): typed metadata, tensor infos in ggml order, memory-mapped data.

Our own strict parser (gguf-py's reader walks every array element through numpy and takes seconds on
a real vocabulary): every length, count and offset is checked against the file before it is used,
so a malformed file raises FormatError instead of allocating or reading out of bounds. Block-quantized
tensors come back as :class:`~inferflow.quant.packed.PackedTensor` and stay quantized.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import FormatError
from ..quant import ggml
from ..quant.packed import PackedTensor
from .source import WeightSource

MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
MAX_NAME = 1 << 16  # keys and tensor names (ggml itself caps tensor names at 64 bytes)
# value type -> struct format (little-endian) of the scalar types
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9
# Arrays kept out of ``config`` (read on demand with ``GGUFSource.array``): the vocabulary-sized
# tokenizer tables, and anything else this long.
_BIG_ARRAY = 4096


@dataclass(slots=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]   # PyTorch order (ggml dims reversed)
    qtype: int
    start: int               # absolute file offset
    nbytes: int


@dataclass(slots=True)
class _LazyArray:
    etype: int
    count: int
    offset: int  # first element


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf: Any, size: int, path: str):
        self.buf, self.size, self.path, self.pos = buf, size, path, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            raise FormatError(self.path, f"truncated or corrupt: {what} at byte {self.pos} needs {n} bytes, "
                                         f"{self.size - self.pos} left in the file")

    def scalar(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str, strict: bool = False) -> str:
        """A string; ``strict``: a key or tensor name (valid UTF-8, at most MAX_NAME bytes)."""
        n = self.scalar("<Q", f"length of {what}")
        if strict and n > MAX_NAME:
            raise FormatError(self.path, f"corrupt: {what} at byte {self.pos - 8} claims {n} bytes")
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            if strict:
                raise FormatError(self.path, f"{what} is not valid UTF-8: {raw[:40]!r}") from None
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, key: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], f"value of {key!r}")
        if vtype == STRING:
            return self.string(f"value of {key!r}")
        raise FormatError(self.path, f"metadata {key!r}: unknown value type {vtype}")

    def array_header(self, key: str) -> _LazyArray:
        etype = self.scalar("<I", f"array type of {key!r}")
        count = self.scalar("<Q", f"array length of {key!r}")
        if etype == ARRAY:
            raise FormatError(self.path, f"metadata {key!r}: nested arrays are not supported")
        if etype not in _SCALARS and etype != STRING:
            raise FormatError(self.path, f"metadata {key!r}: unknown array element type {etype}")
        # every element takes at least its fixed size (8 bytes for a string's length): a count the
        # rest of the file cannot hold is refused before any loop or allocation
        self.need(count * (8 if etype == STRING else struct.calcsize(_SCALARS[etype])), f"array {key!r}")
        return _LazyArray(etype, count, self.pos)

    def skip_array(self, arr: _LazyArray, key: str) -> None:
        if arr.etype != STRING:
            self.pos += arr.count * struct.calcsize(_SCALARS[arr.etype])
            return
        self._strings(arr.count, key, None)

    def read_array(self, arr: _LazyArray, key: str) -> list:
        self.pos = arr.offset
        if arr.etype != STRING:
            out = np.frombuffer(self.buf, dtype=_NP[arr.etype], count=arr.count, offset=arr.offset)
            self.pos = arr.offset + out.nbytes  # past the elements: the next metadata entry starts there
            return out.astype(bool).tolist() if arr.etype == 7 else out.tolist()
        out: list[str] = []
        self._strings(arr.count, key, out)
        return out

    def _strings(self, count: int, key: str, out: list[str] | None) -> None:
        """Walk ``count`` strings from ``pos`` (decoded into ``out`` unless None), with ``string``'s checks and
        decoding: one tight loop, since a vocabulary's 50-150k strings through ``string`` took ~0.25 s per walk."""
        buf, pos, size = self.buf, self.pos, self.size
        length = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if size - pos < 8:
                self.pos = pos
                self.need(8, f"length of string in {key!r}")
            (n,) = length(buf, pos)
            pos += 8
            if n > size - pos:
                self.pos = pos
                self.need(n, f"string in {key!r}")
            if out is not None:
                out.append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos


class GGUFSource(WeightSource):
    """A GGUF file: ``config`` holds the metadata (key -> value; large arrays via :meth:`array`)."""

    kind = "gguf"

    def __init__(self, path: str | os.PathLike):
        self.path = self.config_name = str(path)
        try:
            size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                if size < 24:
                    raise FormatError(self.path, f"truncated: {size} bytes is shorter than a GGUF header")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise FormatError(self.path, f"cannot read: {e}") from None
        self.size = size
        self.config: dict[str, Any] = {}
        self._arrays: dict[str, _LazyArray] = {}
        self.tensors: dict[str, GGUFTensorInfo] = {}
        self._parse(_Cursor(self._mm, size, self.path))
        arch = self.config.get("general.architecture")
        self.arch = arch if isinstance(arch, str) else None
        tokens = self._arrays.get("tokenizer.ggml.tokens")
        if self.arch and f"{self.arch}.vocab_size" not in self.config and tokens is not None:
            # llama.cpp's rule: without {arch}.vocab_size the vocabulary is the token list
            self.config[f"{self.arch}.vocab_size"] = tokens.count

    def _parse(self, c: _Cursor) -> None:
        if bytes(self._mm[:4]) != MAGIC:
            raise FormatError(self.path, f"not a GGUF file (magic {bytes(self._mm[:4])!r})")
        c.pos = 4
        version = c.scalar("<I", "version")
        if version & 0xFFFF == 0:
            raise FormatError(self.path, "big-endian GGUF files are not supported")
        if version not in (2, 3):
            raise FormatError(self.path, f"unsupported GGUF version {version} (supported: 2, 3)")
        n_tensors = c.scalar("<Q", "tensor count")
        n_kv = c.scalar("<Q", "metadata count")
        if n_kv > (self.size - c.pos) // 13 or n_tensors > (self.size - c.pos) // 32:
            raise FormatError(self.path, f"corrupt header: {n_kv} metadata entries and {n_tensors} tensors cannot "
                                         f"fit in {self.size} bytes")
        for _ in range(n_kv):
            key = c.string("metadata key", strict=True)
            if key in self.config or key in self._arrays:
                raise FormatError(self.path, f"duplicate metadata key {key!r}")
            vtype = c.scalar("<I", f"value type of {key!r}")
            if vtype != ARRAY:
                self.config[key] = c.value(vtype, key)
                continue
            arr = c.array_header(key)
            if key.startswith("tokenizer.ggml.") or arr.count > _BIG_ARRAY:
                self._arrays[key] = arr
                c.skip_array(arr, key)
            else:
                self.config[key] = c.read_array(arr, key)
        align = self.config.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise FormatError(self.path, f"general.alignment must be a positive power of two, got {align!r}")
        infos, seen = [], set()
        for _ in range(n_tensors):
            name = c.string("tensor name", strict=True)
            n_dims = c.scalar("<I", f"dimension count of {name!r}")
            if not 1 <= n_dims <= MAX_DIMS:
                raise FormatError(self.path, f"tensor {name!r}: {n_dims} dimensions (ggml allows 1 to {MAX_DIMS})")
            dims = [c.scalar("<Q", f"dimension of {name!r}") for _ in range(n_dims)]
            if max(dims) >= 1 << 62:  # with a zero dimension the size check passes, but no tensor is that long
                raise FormatError(self.path, f"tensor {name!r}: dimension {max(dims)} is out of range")
            qtype = c.scalar("<I", f"type of {name!r}")
            offset = c.scalar("<Q", f"data offset of {name!r}")
            if name in seen:
                raise FormatError(self.path, f"duplicate tensor name {name!r}")
            seen.add(name)
            infos.append((name, dims, qtype, offset))
        data_start = -(-c.pos // align) * align
        spans = []
        for name, dims, qtype, offset in infos:
            info = self._tensor_info(name, dims, qtype, offset, data_start, align)
            self.tensors[name] = info
            if info.nbytes:
                spans.append((info.start, info.start + info.nbytes, name))
        spans.sort()
        for (_, a1, an), (b0, _, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise FormatError(self.path, f"tensors {an!r} and {bn!r} overlap in the data section")

    def _tensor_info(self, name: str, dims: list[int], qtype: int, offset: int, data_start: int,
                     align: int) -> GGUFTensorInfo:
        if qtype not in ggml.GGML_TYPES:
            raise FormatError(self.path, f"tensor {name!r}: unknown ggml type id {qtype}")
        elems, block_bytes = ggml.block_size(qtype)
        if dims[0] % elems:
            raise FormatError(self.path, f"tensor {name!r}: row length {dims[0]} is not a multiple of the "
                                         f"{ggml.type_name(qtype)} block size {elems}")
        numel = 1
        for d in dims:  # Python ints: no overflow, and the size check below bounds them
            numel *= d
        nbytes = numel // elems * block_bytes
        start = data_start + offset
        if offset % align:
            raise FormatError(self.path, f"tensor {name!r}: data offset {offset} is not a multiple of the "
                                         f"alignment {align}")
        if start + nbytes > self.size:
            raise FormatError(self.path, f"tensor {name!r}: {ggml.type_name(qtype)} dims {dims} need {nbytes} bytes "
                                         f"at byte {start}, outside the file ({self.size} bytes)")
        return GGUFTensorInfo(name, tuple(int(d) for d in reversed(dims)), qtype, start, nbytes)

    # ---- WeightSource -------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def tensor_type(self, name: str) -> str:
        return ggml.type_name(self.tensors[name].qtype)

    def dtype_of(self, name: str) -> str:
        return self.tensor_type(name)

    def nbytes(self, name: str) -> int:
        return self.tensors[name].nbytes

    def get(self, name: str) -> torch.Tensor | PackedTensor:
        info = self.tensors[name]
        if info.qtype in ggml.PLAIN_DTYPES:
            dtype = ggml.PLAIN_DTYPES[info.qtype]
            if info.nbytes == 0:
                return torch.empty(info.shape, dtype=dtype)
            if info.start % dtype.itemsize:  # unusual alignment: copy rather than map unaligned
                raw = bytearray(self._mm[info.start:info.start + info.nbytes])
                return torch.frombuffer(raw, dtype=dtype).view(info.shape)
            return torch.frombuffer(self._mm, dtype=dtype, count=info.nbytes // dtype.itemsize,
                                    offset=info.start).view(info.shape)
        ggml.check_supported(info.qtype, name, self.path)
        elems, block_bytes = ggml.block_size(info.qtype)
        data = torch.frombuffer(self._mm, dtype=torch.uint8, count=info.nbytes, offset=info.start) if info.nbytes \
            else torch.empty(0, dtype=torch.uint8)  # frombuffer refuses count 0 (a tensor with a zero dimension)
        return PackedTensor(data.view(*info.shape[:-1], info.shape[-1] // elems * block_bytes), info.qtype, info.shape)

    # ---- metadata -------------------------------------------------------------------------------------
    def has_array(self, key: str) -> bool:
        return key in self._arrays or isinstance(self.config.get(key), list)

    def array(self, key: str) -> list | None:
        """A metadata array as a list (the big tokenizer tables are parsed here, on demand)."""
        if key in self.config:
            v = self.config[key]
            return v if isinstance(v, list) else None
        arr = self._arrays.get(key)
        return None if arr is None else _Cursor(self._mm, self.size, self.path).read_array(arr, key)

    def array_length(self, key: str) -> int | None:
        if key in self._arrays:
            return self._arrays[key].count
        v = self.config.get(key)
        return len(v) if isinstance(v, list) else None
