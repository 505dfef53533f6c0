"""Cross-kernel L2 prefetch in captured decode steps: each CUDA 4-bit kernel also pulls the *next* 4-bit matmul's
weight into the GPU's L2 cache (``inferflow_cuda::Prefetch`` in ``inferflow/native/cuda_common.cuh``).

Why: a batch-1 decode step reads every weight once, and one 9-56 MB GEMV keeps DRAM busy for only part of its
time (ncu: a bare read of 9-14 MB reaches 1.8-2.2 TB/s of ~4): the kernel's ramp-up and tail, the launch gaps and
the small kernels in between (norms, RoPE, attention) leave DRAM idle. A prefetch issued by the bulk-copy engine
fills those gaps, and the next GEMV then reads from L2.

Which weight comes next is learned, not declared (no model code names its layers): the engine's warm-up run of a
decode bucket records the order of its 4-bit matmuls (:func:`recording`), and the capture that follows
(:func:`capturing`) hands call i the weight of call i + 1 (the last one: the first one's, for the next step). A
capture whose calls stop matching the recorded order prefetches nothing from there on. Eager calls never prefetch.

``INFERFLOW_L2_PREFETCH``: ``start`` (default: issued as a kernel starts), ``end`` (after each block's own loads) or
``0``/``off``. ``INFERFLOW_L2_PREFETCH_MB`` (default 24): the most bytes of one weight prefetched; more than L2
holds would evict its own first part before it is read.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

ENV = "INFERFLOW_L2_PREFETCH"
CAP_ENV = "INFERFLOW_L2_PREFETCH_MB"
PDL_ENV = "INFERFLOW_PDL"
DEFAULT_CAP_MB = 24.0


class Prefetch(ctypes.Structure):
    """``inferflow_cuda::Prefetch``: two byte ranges (codes, scales) and where in the kernel to issue them."""

    _fields_ = [("p0", ctypes.c_void_p), ("p1", ctypes.c_void_p), ("n0", ctypes.c_uint), ("n1", ctypes.c_uint),
                ("at_end", ctypes.c_int), ("pdl", ctypes.c_int)]


def address(pf: Prefetch | None) -> int | None:
    """A kernel entry point's ``prefetch`` argument: the struct's address (the caller keeps it alive) or NULL."""
    return ctypes.addressof(pf) if pf is not None else None


def mode() -> str | None:
    """``"start"``, ``"end"`` or None (off), from ``$INFERFLOW_L2_PREFETCH``."""
    v = os.environ.get(ENV, "start").strip().lower()
    if v in ("0", "off", "false", "no", ""):
        return None
    if v not in ("start", "end"):
        raise ValueError(f"${ENV}: expected start, end or 0, got {v!r}")
    return v


def cap_bytes() -> int:
    """The most bytes of one weight to prefetch, from ``$INFERFLOW_L2_PREFETCH_MB``."""
    raw = os.environ.get(CAP_ENV, str(DEFAULT_CAP_MB))
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"${CAP_ENV}: expected megabytes, got {raw!r}") from None
    return max(0, min(int(mb * 2**20), 2**31 - 16))


def describe(regions: Sequence[torch.Tensor], at_end: bool, cap: int) -> Prefetch:
    """The Prefetch of ``regions`` (a weight's codes and scales): their leading parts, the same fraction of each,
    ``cap`` bytes in all at most."""
    codes, scales = regions[0], regions[1] if len(regions) > 1 else None
    nc = codes.numel() * codes.element_size()
    ns = scales.numel() * scales.element_size() if scales is not None else 0
    frac = min(1.0, cap / max(1, nc + ns))
    return Prefetch(codes.data_ptr(), scales.data_ptr() if scales is not None else None,
                    int(nc * frac) & ~15, int(ns * frac) & ~15, int(at_end))


@dataclass(slots=True)
class _Scope:
    capture: bool                      # False: recording the order
    order: list = field(default_factory=list)  # each call's regions (tensors), in call order
    index: int = 0
    ok: bool = True


_scope: _Scope | None = None


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Record the order of the 4-bit matmuls run inside (their weights' regions); yields the list it fills."""
    global _scope
    prev, _scope = _scope, _Scope(capture=False)
    try:
        yield _scope.order
    finally:
        _scope = prev


@contextlib.contextmanager
def capturing(order: list) -> Iterator[None]:
    """Inside: call i of a recorded ``order`` prefetches call i + 1's weight (see the module doc)."""
    global _scope
    prev, _scope = _scope, _Scope(capture=True, order=order)
    try:
        yield
    finally:
        _scope = prev


def visit(regions: Sequence[torch.Tensor]) -> Prefetch | None:
    """Called by every 4-bit matmul with the tensors it reads: records them, or returns what this call should
    prefetch (None: nothing)."""
    s = _scope
    if s is None:
        return None
    if not s.capture:
        s.order.append(tuple(regions))
        return None
    i, s.index = s.index, s.index + 1
    if not s.ok or i >= len(s.order) or s.order[i][0].data_ptr() != regions[0].data_ptr():
        s.ok = False  # another order than recorded: prefetching the wrong bytes would only cost bandwidth
        return None
    how, pdl = mode(), os.environ.get(PDL_ENV, "0").strip().lower() in ("1", "on", "true", "yes")
    nxt = s.order[(i + 1) % len(s.order)]
    size = sum(t.numel() * t.element_size() for t in nxt)
    small = size <= float(os.environ.get("INFERFLOW_L2_PREFETCH_MAX_MB", "1e9")) * 2**20
    if how is not None and len(s.order) >= 2 and small:
        pf = describe(nxt, how == "end", cap_bytes())
    elif pdl:
        pf = Prefetch()
    else:
        return None
    pf.pdl = int(pdl)
    return pf
