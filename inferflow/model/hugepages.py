"""CPU weights and K/V cache in transparent huge pages (2 MiB) where Linux offers them on request.

Why: a CPU decode step streams every weight from memory once, and with 4 KiB pages each page costs a TLB miss and
a page walk that the hardware prefetchers stop at. On this project's 2-core test VM (``tools/bench_hugepages.py``)
the same native GEMVs read 5-10% faster from huge pages. Linux's usual setting (``transparent_hugepage=madvise``)
gives huge pages only to memory that asks for them, and neither torch's allocator nor a memory-mapped model file
asks: so the large CPU tensors of a model (and the K/V cache) are moved into private anonymous mappings that do.

The mapping belongs to the tensor: ``torch.frombuffer`` keeps the ``mmap`` object alive while any tensor views it,
and the last one to go unmaps it. ``INFERFLOW_HUGEPAGES=0`` switches this off.
"""
from __future__ import annotations

import mmap
import os
import sys

import torch
from torch import nn

HUGE = 2 << 20
MIN_BYTES = HUGE  # smaller storages cannot fill one huge page


def enabled() -> bool:
    """True where huge pages can be asked for (Linux, madvise available) and are not switched off."""
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("INFERFLOW_HUGEPAGES", "1") != "0")


def empty_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` whose whole 2 MiB pieces are in huge pages (zero-filled, as fresh anonymous
    memory is)."""
    # private (a shared anonymous mapping is shmem, which has its own huge-page setting), with one huge page of
    # slack so the tensor can start on a 2 MiB boundary: untouched slack costs address space, not memory
    mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    head = -t.data_ptr() % HUGE
    whole = nbytes // HUGE * HUGE
    if whole:
        try:
            mm.madvise(mmap.MADV_HUGEPAGE, head, whole)
        except OSError:
            pass  # kernels without THP: ordinary pages
    return t[head:head + nbytes]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.empty(0, dtype=dtype).element_size()
    for s in shape:
        n *= int(s)
    return n


class Arena:
    """Zeroed CPU tensors carved from one huge-page mapping (many small tensors, such as one K/V store per layer,
    together fill huge pages that each alone would not); plain ``torch.zeros`` where huge pages are off or the
    whole is under one huge page. Tensors start on 64-byte boundaries."""

    __slots__ = ("_buf", "_used")

    def __init__(self, shapes: list[tuple[tuple[int, ...], torch.dtype]]):
        total = sum(-(-_nbytes(s, d) // 64) * 64 for s, d in shapes)
        self._buf = empty_bytes(total) if enabled() and total >= MIN_BYTES else None
        self._used = 0

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next tensor (each shape of the constructor's list once; others fall back to ``torch.zeros``)."""
        n = _nbytes(shape, dtype)
        if self._buf is None or self._used + n > self._buf.numel():
            return torch.zeros(shape, dtype=dtype)
        t = self._buf[self._used:self._used + n].view(dtype).view(shape)
        self._used += -(-n // 64) * 64
        return t


def move_module(net: nn.Module) -> int:
    """Move the storage of every CPU parameter and buffer of ``net`` of at least 2 MiB into huge pages, in place
    (tensors sharing a storage, as tied or fused weights do, keep sharing it); returns the bytes moved. Call it
    before anything records the tensors' data pointers."""
    if not enabled():
        return 0
    tensors = [t for t in (*net.parameters(), *net.buffers()) if t.device.type == "cpu" and not t.is_meta]
    moved: dict[int, tuple[torch.UntypedStorage, int]] = {}  # old storage -> (new storage, its first byte)
    total = 0
    with torch.no_grad():
        for t in tensors:
            st = t.untyped_storage()
            key = st.data_ptr()
            if key not in moved:
                if st.nbytes() < MIN_BYTES:
                    continue
                new = empty_bytes(st.nbytes())
                new.copy_(torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,)))
                moved[key] = new.untyped_storage(), new.storage_offset()
                total += st.nbytes()
            # set_ rebinds this very tensor (a Parameter stays the same Parameter object); the new storage starts
            # at a 2 MiB boundary inside its mapping, a multiple of any element size
            storage, first = moved[key]
            t.set_(storage, first // t.element_size() + t.storage_offset(), t.size(), t.stride())
    return total

