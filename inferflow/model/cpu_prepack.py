"""CPU: bfloat16 linears keep a oneDNN-packed copy of their weight for inputs of several rows.

``F.linear`` in bfloat16 on the CPU already runs oneDNN's GEMM, but re-lays the weight out for it at every call;
an 8-row decode step of SmolLM2-135M spends ~18% less time with the layout done once (1 thread, the very same
bits: oneDNN computes the same products either way). Inputs of 1-16 rows (decode steps) go to the native kernels
first where they are built (``inferflow/native/float_linear.py``), so the packed copy mostly serves prefill.

The copy costs the weight's bytes again, so only models whose bfloat16 weights fit a quarter of the free memory
are packed. Nothing here knows a model family: every plain bfloat16 ``linear`` component is a candidate.

``INFERFLOW_CPU_PREPACK=0`` switches this off; ``=float32`` packs float32 linears too (opt-in: oneDNN's float32 GEMM
is ~1.7x faster than MKL's for an 8-row step of SmolLM2-135M at 1 thread, but rounds differently, ~1e-6 relative,
so float32 results stop matching the unpacked path bit for bit).
"""
from __future__ import annotations

import os

import torch
from torch import nn

KEY = "cpu_packed"  # Linear.__dict__[KEY] = (the weight parameter packed, its packed copy)


def _plain(m: nn.Module, dtypes: tuple[torch.dtype, ...]) -> bool:
    w = getattr(m, "weight", None)
    return (type(m).__name__ == "Linear" and getattr(m, "packed", None) is None and isinstance(w, torch.Tensor)
            and w.dtype in dtypes and w.device.type == "cpu" and not w.is_meta and w.dim() == 2)


def _free_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def prepack_linears(net: nn.Module, *, rows: int = 8, budget: float = 0.25) -> int:
    """Give every plain CPU bfloat16 (opt-in: and float32) linear of ``net`` a packed weight (tuned for ``rows``-row
    inputs); returns how many were packed (0 when oneDNN is missing or the copies would exceed ``budget`` of the free
    memory)."""
    mode = os.environ.get("INFERFLOW_CPU_PREPACK", "1")
    if mode == "0" or not torch.backends.mkldnn.is_available():
        return 0
    dtypes = (torch.bfloat16, torch.float32) if mode == "float32" else (torch.bfloat16,)
    lins = [m for m in net.modules() if _plain(m, dtypes) and KEY not in m.__dict__]
    # parts of a fused projection (model/fuse.py) are views into its weight and never run in its stead: where
    # several candidates share one storage, only a weight spanning all of it is packed
    share: dict[int, int] = {}
    for m in lins:
        ptr = m.weight.untyped_storage().data_ptr()
        share[ptr] = share.get(ptr, 0) + 1
    lins = [m for m in lins if share[m.weight.untyped_storage().data_ptr()] == 1
            or m.weight.untyped_storage().nbytes() == m.weight.numel() * m.weight.element_size()]
    total = sum(m.weight.numel() * m.weight.element_size() for m in lins)
    if not lins or total > budget * _free_bytes():
        return 0
    try:
        done: dict[int, torch.Tensor] = {}  # one copy per parameter (linears tied to one weight)
        for m in lins:
            w = m._parameters["weight"]
            if id(w) not in done:
                done[id(w)] = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows)
            m.__dict__[KEY] = (w, done[id(w)])
    except (RuntimeError, AttributeError):  # an op this build lacks: the plain path stays
        for m in lins:
            m.__dict__.pop(KEY, None)
        return 0
    return len(lins)
