"""CPU weights and K/V cache in transparent huge pages (2 MiB) where Linux offers them on request.

Why: a CPU decode step streams every weight from memory once, and with 4 KiB pages each page costs a TLB miss and
a page walk. Linux's usual setting (``transparent_hugepage=madvise``) gives huge pages only to memory that asks for
them, and neither torch's allocator nor a memory-mapped model file asks. So the engine moves a CPU model's
parameters and buffers into one private anonymous mapping that does, and carves the K/V stores from another. On
this project's 2-core test VM a decode step ran 3.5-7% faster (``tools/bench_hugepages.py``, docs/benchmarks.md).

Each tensor keeps a storage of its own (``torch.frombuffer`` over a piece of the mapping), and the mapping lives as
long as any of them. ``INFERFLOW_HUGEPAGES=0`` switches this off.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading

import torch
from torch import nn

HUGE = 2 << 20
MIN_BYTES = HUGE  # a whole smaller than one huge page stays where it is
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; Python's mmap names it from 3.13


POPULATE_CHUNK = 16 << 20  # bytes per MADV_POPULATE_WRITE call (_populate)
_filling: list[threading.Thread] = []  # populate threads not yet joined (settle)


def _populate(mm: mmap.mmap, addr: int, nbytes: int) -> None:
    # Through ctypes, which releases the GIL for the call (mmap.madvise holds it for the whole syscall), and in
    # 16 MiB pieces: the call holds the process's mmap lock for reading, and a whole 1 GiB at once kept the other
    # thread's next mmap (the weights' arena, torch's large buffers) waiting for all of it (1.5-1.7 s of cold pages).
    libc = ctypes.CDLL(None, use_errno=True)
    for off in range(0, nbytes, POPULATE_CHUNK):
        n = min(POPULATE_CHUNK, nbytes - off)
        if libc.madvise(ctypes.c_void_p(addr + off), ctypes.c_size_t(n), ctypes.c_int(MADV_POPULATE_WRITE)):
            return  # kernels before 5.14 (EINVAL): pages fault in on first touch


def settle() -> None:
    """Wait for the arenas' page population started so far (tests and benchmarks that look at residency)."""
    while _filling:
        _filling.pop().join()


def enabled() -> bool:
    """True where huge pages can be asked for (Linux, madvise available) and are not switched off."""
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("INFERFLOW_HUGEPAGES", "1") != "0")


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping of ``nbytes`` (plus one huge page of slack) that asks for huge pages from the
    returned offset, a 2 MiB boundary, on."""
    # private: a shared anonymous mapping is shmem, which has its own huge-page setting. The slack lets the data start
    # on a 2 MiB boundary: untouched pages cost address space, not memory
    mm = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    head = -torch.frombuffer(mm, dtype=torch.uint8, count=1).data_ptr() % HUGE
    try:  # all of it from head on: the last, partly used huge page too (one per mapping)
        mm.madvise(mmap.MADV_HUGEPAGE, head, len(mm) - head)
    except OSError:
        pass  # kernels without THP: ordinary pages
    return mm, head


def empty_bytes(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` (its own storage) whose whole 2 MiB pieces are in huge pages, zero-filled as
    fresh anonymous memory is (pages are faulted in on first touch)."""
    mm, head = _mapping(nbytes)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=head)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = torch.empty(0, dtype=dtype).element_size()
    for s in shape:
        n *= int(s)
    return n


def _round(n: int) -> int:
    return -(-n // 64) * 64


class Arena:
    """Zeroed CPU tensors carved from one huge-page mapping, each with its own storage (many small tensors, such as
    one K/V store per layer, together fill huge pages that each alone would not); plain ``torch.zeros`` where huge
    pages are off or the whole is under one huge page. Tensors start on 64-byte boundaries; the mapping is freed
    with the last of them."""

    __slots__ = ("_mm", "_head", "_size", "_used")

    def __init__(self, sizes: list[int], populate: bool = False):
        """``sizes``: the bytes of each tensor to come. ``populate``: fault every page in (as ``torch.zeros`` would
        by writing them), where the kernel can, on a thread of its own. A first touch of a huge page can be slow:
        on this project's test VM ~4.5 ms per 2 MiB, up to 1.6 s for a 1 GiB cache, while the host backs guest
        memory that was freed (``compact_stall`` stays 0: not compaction). A K/V store would otherwise pay that in
        the middle of a request (the first prefill of the default model: 361 ms, of which 290 ms were these
        faults), and the caller at start-up if it waited. The arena's tensors are usable at once: a page touched
        before the thread gets to it faults in as usual."""
        total = sum(_round(n) for n in sizes)
        self._mm, self._head = _mapping(total) if enabled() and total >= MIN_BYTES else (None, 0)
        self._size, self._used = total, 0
        if populate and self._mm is not None:
            addr = torch.frombuffer(self._mm, dtype=torch.uint8, count=1, offset=self._head).data_ptr()
            # the thread holds the mapping: it cannot be unmapped under the call
            th = threading.Thread(target=_populate, args=(self._mm, addr, total), name="inferflow-kv-populate",
                                  daemon=True)
            _filling[:] = [t for t in _filling if t.is_alive()]
            _filling.append(th)
            th.start()

    @classmethod
    def for_shapes(cls, shapes: list[tuple[tuple[int, ...], torch.dtype]], populate: bool = False) -> "Arena":
        return cls([_nbytes(s, d) for s, d in shapes], populate)

    def take(self, nbytes: int) -> torch.Tensor | None:
        """The next ``nbytes`` as a uint8 tensor of its own storage; None past the arena's size or when it is off."""
        if self._mm is None or nbytes == 0 or self._used + nbytes > self._size:
            return None
        t = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=self._head + self._used)
        self._used += _round(nbytes)
        return t

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor (from the arena where it fits, else ``torch.zeros``)."""
        t = self.take(_nbytes(shape, dtype))
        return torch.zeros(shape, dtype=dtype) if t is None else t.view(dtype).view(shape)


def move_module(net: nn.Module) -> int:
    """Move the storage of every CPU parameter and buffer of ``net`` into one huge-page arena, in place (tensors
    sharing a storage, as tied or fused weights do, keep sharing it; each storage stays its own); returns the bytes
    moved. Nothing is moved where the whole is under one huge page, and nothing twice (storages it moved before stay
    where they are, so a second engine on the same model leaves the first one's pointers valid). Call it before
    anything records the tensors' data pointers."""
    if not enabled():
        return 0
    # a second engine on the same model must not move what the first one's native program points at
    done: set[int] = net.__dict__.setdefault("_hugepage_storages", set())
    tensors = [t for t in (*net.parameters(), *net.buffers()) if t.device.type == "cpu" and not t.is_meta
               and t.untyped_storage().data_ptr() not in done]
    olds: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            olds.setdefault(st.data_ptr(), st)
    arena = Arena([st.nbytes() for st in olds.values()])
    new: dict[int, torch.UntypedStorage] = {}
    with torch.no_grad():
        for key, st in olds.items():
            t = arena.take(st.nbytes())
            if t is None:
                return 0  # off, or too small to fill a huge page: nothing rebound yet
            t.copy_(torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,)))
            new[key] = t.untyped_storage()
        for t in tensors:
            st = t.untyped_storage()
            if st.nbytes():
                # set_ rebinds this very tensor: a Parameter stays the same Parameter object
                t.set_(new[st.data_ptr()], t.storage_offset(), t.size(), t.stride())
    done.update(st.data_ptr() for st in new.values())
    return sum(st.nbytes() for st in olds.values())


def drop_file_pages(maps: list[mmap.mmap]) -> None:
    """Drop the resident pages of model-file mappings whose tensors :func:`move_module` copied: the copies are the
    ones in use, and the file's pages would otherwise count twice in the process's memory. The mappings stay valid
    (private and never written: a later read faults the file's bytes back in)."""
    for m in maps:
        try:
            m.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError, AttributeError):
            pass
