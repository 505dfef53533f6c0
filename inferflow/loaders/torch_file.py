"""``torch.save`` files read without torch.load: the zip container (torch >= 1.6) and the legacy stream.

The pickle is run by our own interpreter (pickle_reader); tensors come back as lazy :class:`TensorRef`
records (storage, offset, size, stride) that are materialised only on ``get``, as views of a
copy-on-write memory map where the storage is stored uncompressed and aligned.
"""
from __future__ import annotations

import mmap
import os
import struct
import zipfile
import zlib
from typing import Any

import torch

from ..errors import FormatError
from .pickle_globals import StorageType, allowed_globals
from .pickle_reader import load_pickle

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
MAX_PICKLE = 1 << 30
MAX_DEFLATE_RATIO = 1100  # deflate cannot expand more than ~1032x; a larger declared size is a lie
MAX_PICKLE_RATIO = 64  # a pickle compresses a few times, not a thousand: a larger ratio is a decompression bomb


class StorageRef:
    """One storage of the file: its key, element dtype and element count (data read on demand)."""

    __slots__ = ("file", "key", "dtype", "numel", "view")

    def __init__(self, file: "TorchFile", key: str, dtype: torch.dtype, numel: int,
                 view: tuple[int, int] | None = None):
        self.file, self.key, self.dtype, self.numel, self.view = file, key, dtype, numel, view

    def flat(self) -> torch.Tensor:
        """All elements as a 1-D tensor of ``dtype``."""
        raw = self.file.storage_bytes(self.key)
        if self.view is not None:  # legacy storage views: (element offset, element count) of the root
            size = self.dtype.itemsize
            raw = raw[self.view[0] * size:(self.view[0] + self.view[1]) * size]
        usable = raw.numel() - raw.numel() % self.dtype.itemsize
        return raw[:usable].view(self.dtype)


class TensorRef:
    """A tensor as the pickle describes it; ``load()`` builds it with as_strided on the storage."""

    __slots__ = ("storage", "dtype", "offset", "size", "stride")

    def __init__(self, storage: StorageRef, dtype: torch.dtype, offset: int, size: tuple[int, ...],
                 stride: tuple[int, ...]):
        self.storage, self.dtype, self.offset, self.size, self.stride = storage, dtype, offset, size, stride

    def load(self) -> torch.Tensor:
        flat = self.storage.flat()
        if self.dtype != self.storage.dtype:  # _rebuild_tensor_v3: untyped bytes reinterpreted
            flat = flat[:flat.numel() - flat.numel() % self.dtype.itemsize].view(self.dtype)
        if _extent(self.offset, self.size, self.stride) > flat.numel():
            raise FormatError(self.storage.file.path, f"storage {self.storage.key!r} holds {flat.numel()} elements, "
                                                      f"too few for a tensor of size {list(self.size)}")
        return torch.as_strided(flat, self.size, self.stride, self.offset)


def _extent(offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements of the storage a strided view touches (0 when it is empty)."""
    if any(s == 0 for s in size):
        return 0
    return offset + 1 + sum((n - 1) * st for n, st in zip(size, stride))


def _ints(v: Any, what: str, n: int | None = None) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or len(v) > 16 or (n is not None and len(v) != n) or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62 for x in v):
        raise TypeError(f"{what} must be a tuple of non-negative ints")
    return tuple(v)


class TorchFile:
    """A parsed torch file: ``obj`` is the unpickled root (plain containers with TensorRef leaves)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._mm: mmap.mmap | None = None
        self._cache: dict[str, torch.Tensor] = {}
        self.storages: dict[str, StorageRef] = {}
        self.globals = allowed_globals({
            "_rebuild_tensor": self._rebuild, "_rebuild_tensor_v2": self._rebuild,
            "_rebuild_tensor_v3": self._rebuild_v3, "_rebuild_parameter": self._parameter,
            "_rebuild_parameter_with_state": self._parameter})
        try:
            self.size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                head = f.read(4)
                if self.size and head:
                    self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise FormatError(self.path, f"cannot read: {e}") from None
        if head == b"PK\x03\x04":
            self._open_zip()
        elif head[:1] == b"\x80":
            self._open_legacy()
        else:
            raise FormatError(self.path, "not a torch.save file (neither a zip archive nor a pickle stream)")

    # ---- pickle callbacks: only the shapes torch.save writes are accepted ---------------------------
    def _rebuild(self, storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRef:
        if not isinstance(storage, StorageRef) or len(rest) > 3:
            raise TypeError("expected (storage, offset, size, stride, ...)")
        return self._tensor(storage, storage.dtype, offset, size, stride)

    def _rebuild_v3(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                    dtype: Any, metadata: Any = None) -> TensorRef:
        if not isinstance(storage, StorageRef) or not isinstance(dtype, torch.dtype):
            raise TypeError("expected (storage, offset, size, stride, requires_grad, hooks, dtype)")
        return self._tensor(storage, dtype, offset, size, stride)

    def _tensor(self, storage: StorageRef, dtype: torch.dtype, offset: Any, size: Any, stride: Any) -> TensorRef:
        size, stride = _ints(size, "size"), _ints(stride, "stride", len(size))
        (offset,) = _ints((offset,), "storage offset")
        elems = storage.numel * storage.dtype.itemsize // dtype.itemsize
        if _extent(offset, size, stride) > elems:
            raise ValueError(f"view (offset {offset}, size {list(size)}, stride {list(stride)}) runs past storage "
                             f"{storage.key!r} of {elems} elements")
        numel = 1
        for n in size:
            numel *= n
        if numel > max(16 * elems, 1 << 20):  # stride-0 views could otherwise expand to any size
            raise ValueError(f"tensor of {numel} elements from a storage of {elems}")
        return TensorRef(storage, dtype, offset, size, stride)

    @staticmethod
    def _parameter(data: Any, *rest: Any) -> TensorRef:
        if not isinstance(data, TensorRef) or len(rest) > 3:
            raise TypeError("expected (tensor, requires_grad, hooks[, state])")
        return data

    def _persistent_load(self, pid: Any) -> StorageRef:
        # zip: ('storage', type, key, location, numel); legacy adds view_metadata
        if (not isinstance(pid, tuple) or len(pid) not in (5, 6) or pid[0] != "storage"
                or not isinstance(pid[1], StorageType) or not isinstance(pid[2], str)
                or not isinstance(pid[4], int) or not 0 <= pid[4] < 1 << 62):
            raise FormatError(self.path, "unsupported persistent id (expected a ('storage', type, key, "
                                         "location, numel) record)")
        stype, key, numel = pid[1], pid[2], pid[4]
        dtype = stype.dtype
        if numel * dtype.itemsize > self.size * MAX_DEFLATE_RATIO + (1 << 20):
            raise FormatError(self.path, f"storage {key!r} declares {numel} elements, more than the file can hold")
        known = self.storages.get(key)
        if known is not None and known.dtype != dtype:
            raise FormatError(self.path, f"storage {key!r} is used with two dtypes ({known.dtype}, {dtype})")
        ref = self.storages.setdefault(key, StorageRef(self, key, dtype, numel))
        view = pid[5] if len(pid) == 6 else None
        if view is None:
            return ref
        if (not isinstance(view, tuple) or len(view) != 3 or not all(isinstance(v, int) for v in view[1:])
                or view[1] < 0 or view[2] < 0 or view[1] + view[2] > numel):
            raise FormatError(self.path, f"bad storage view {type(view).__name__} on {key!r}")
        return StorageRef(self, key, dtype, view[2], (view[1], view[2]))

    # ---- containers ---------------------------------------------------------------------------------
    def _open_zip(self) -> None:
        try:
            self._zip = zipfile.ZipFile(self.path)
            infos = {i.filename: i for i in self._zip.infolist()}
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as e:  # N.I.E.: zip version
            raise FormatError(self.path, f"bad zip archive: {e}") from None
        pkls = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1] or (
            ["data.pkl"] if "data.pkl" in infos else [])
        if len(pkls) != 1:
            raise FormatError(self.path, "zip archive has no (or several) */data.pkl: not a torch.save file")
        self.prefix = pkls[0][:-len("data.pkl")]
        order = infos.get(self.prefix + "byteorder")
        if order is not None and self._member(order, 16) != b"little":
            raise FormatError(self.path, "big-endian torch files are not supported")
        self._infos = infos
        data = self._member(infos[pkls[0]], MAX_PICKLE, MAX_PICKLE_RATIO)
        self.obj, _ = load_pickle(data, self.path, self.globals, self._persistent_load)
        for key in self.storages:
            info = infos.get(f"{self.prefix}data/{key}")
            need = self.storages[key].numel * self.storages[key].dtype.itemsize
            if info is None or info.file_size < need:
                raise FormatError(self.path, f"storage {key!r}: member {self.prefix}data/{key} missing or smaller "
                                             f"than {need} bytes")

    def _member(self, info: zipfile.ZipInfo, cap: int, ratio: int = MAX_DEFLATE_RATIO) -> bytes:
        if info.file_size > cap or (info.compress_type != zipfile.ZIP_STORED
                                    and info.file_size > info.compress_size * ratio + 1024):
            raise FormatError(self.path, f"zip member {info.filename} declares an implausible size {info.file_size}")
        try:
            return self._zip.read(info)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, RuntimeError,
                zlib.error) as e:  # zlib.error: a corrupt deflate stream
            raise FormatError(self.path, f"zip member {info.filename}: {e}") from None

    def _open_legacy(self) -> None:
        mm, pos, values = self._mm, 0, []
        for _ in range(3):  # magic number, protocol version, sys info
            v, pos = load_pickle(mm, self.path, self.globals, None, pos)
            values.append(v)
        if values[0] != LEGACY_MAGIC or values[1] != LEGACY_PROTOCOL:
            raise FormatError(self.path, "a pickle stream but not a torch.save file (bad magic number / protocol)")
        if not isinstance(values[2], dict) or values[2].get("little_endian") is not True:
            raise FormatError(self.path, "big-endian (or unknown byte order) legacy torch files are not supported")
        self.obj, pos = load_pickle(mm, self.path, self.globals, self._persistent_load, pos)
        keys, pos = load_pickle(mm, self.path, self.globals, None, pos)
        if not isinstance(keys, list) or not all(isinstance(k, str) and k in self.storages for k in keys):
            raise FormatError(self.path, "legacy storage-key list is malformed or names unknown storages")
        self._offsets: dict[str, tuple[int, int]] = {}
        for key in keys:
            if pos + 8 > self.size:
                raise FormatError(self.path, f"truncated before storage {key!r}")
            (numel,) = struct.unpack("<q", mm[pos:pos + 8])
            nbytes = numel * self.storages[key].dtype.itemsize
            if numel < self.storages[key].numel or pos + 8 + nbytes > self.size:
                raise FormatError(self.path, f"storage {key!r}: {numel} elements at byte {pos} do not fit the file "
                                             f"or the pickle's declared size")
            self._offsets[key] = (pos + 8, nbytes)
            pos += 8 + nbytes
        missing = set(self.storages) - set(self._offsets)
        if missing:
            raise FormatError(self.path, f"storages {sorted(missing)[:4]} are referenced but not stored")

    # ---- data ---------------------------------------------------------------------------------------
    def storage_bytes(self, key: str) -> torch.Tensor:
        """The raw bytes of one storage as a uint8 tensor (memory-mapped when stored and aligned)."""
        t = self._cache.get(key)
        if t is not None:
            return t
        if hasattr(self, "_offsets"):
            start, nbytes = self._offsets[key]
        else:
            info = self._infos[f"{self.prefix}data/{key}"]
            nbytes, start = info.file_size, -1
            if info.compress_type == zipfile.ZIP_STORED:
                start = self._data_start(info)
        if nbytes == 0:
            t = torch.empty(0, dtype=torch.uint8)
        elif start >= 0 and start % 64 == 0:
            t = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=start)
        elif start >= 0:  # misaligned: copy so typed views are aligned
            t = torch.frombuffer(bytearray(self._mm[start:start + nbytes]), dtype=torch.uint8)
        else:
            t = torch.frombuffer(bytearray(self._member(info, nbytes)), dtype=torch.uint8)
        self._cache[key] = t
        return t

    def _data_start(self, info: zipfile.ZipInfo) -> int:
        h = info.header_offset
        head = self._mm[h:h + 30]
        if len(head) < 30 or head[:4] != b"PK\x03\x04":
            raise FormatError(self.path, f"zip member {info.filename}: bad local header")
        n, m = struct.unpack("<HH", head[26:30])
        start = h + 30 + n + m
        if start + info.file_size > self.size:
            raise FormatError(self.path, f"zip member {info.filename} runs past the end of the file")
        return start
