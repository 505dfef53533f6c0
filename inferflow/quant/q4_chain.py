"""The chained 4-bit GEMVs of a decode layer in one persistent kernel (``inferflow/native/q4_chain.cu``, which says
why): the ctypes mirror of its stage table, the stage builders and the launch.

A chain is a list of :class:`Stage`: a Q4_0 weight in the tensor-core layout (quant/cuda_q4_mma.py), its output
and the prologue that makes its input from earlier tensors (a copy, the residual add + RMSNorm, or the SwiGLU
product). Sm_90 (Hopper) and later, 1-2 activation rows, bf16/fp16 activations.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ..native import cuda

# (W warps, U column tiles per warp step, S ring slots, FOLD, MINB), q4_chain.cu's order; FOLD: -8 applied to the
# block sums (one instruction per weight pair fewer, float32 cancellation); MINB: blocks per SM
CONFIGS: tuple[tuple[int, int, int, bool, int], ...] = (
    (16, 2, 8, False, 1), (8, 2, 6, False, 2), (4, 4, 6, False, 2), (8, 1, 8, False, 3), (4, 2, 8, False, 4),
    (16, 2, 6, False, 1), (16, 2, 6, False, 1), (16, 2, 6, False, 1), (4, 2, 6, False, 4))
# 6, 8: weights streamed only (no prologue, GEMV or barrier); 7: no GEMV arithmetic (diagnostics)
MAX_STAGES = 6
MAX_ROWS = 2
COPY, ADD_NORM, SILU_MUL = 0, 1, 2
_DTYPE = {torch.bfloat16: 1, torch.float16: 2}
_P, _LL, _I, _F = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_float


class _Stage(ctypes.Structure):
    _fields_ = [("codes", _P), ("scales", _P), ("bias", _P), ("y", _P), ("inp", _P), ("resid", _P),
                ("resid_out", _P), ("norm_out", _P), ("norm_w", _P), ("sin", _LL), ("sres", _LL), ("n", _I),
                ("kt", _I), ("kind", _I), ("weight_in_float", _I), ("eps", _F), ("offset", _F)]


class _Chain(ctypes.Structure):
    _fields_ = [("st", _Stage * MAX_STAGES), ("count", _I)]


@dataclass(slots=True)
class Stage:
    """One GEMV of a chain: ``y = input @ W^T (+ bias)``, its input made by the prologue ``kind`` from ``inp``
    (COPY: ``inp`` itself; SILU_MUL: silu(gate) * up of ``inp`` = gate | up; ADD_NORM: rmsnorm(resid + inp), the
    sum written to ``resid_out`` and the norm to ``norm_out``; ``resid`` None: the previous ADD_NORM's sum)."""

    codes: torch.Tensor
    scales: torch.Tensor
    y: torch.Tensor
    inp: torch.Tensor
    kind: int = COPY
    bias: torch.Tensor | None = None
    resid: torch.Tensor | None = None
    resid_out: torch.Tensor | None = None
    norm_out: torch.Tensor | None = None
    norm_w: torch.Tensor | None = None
    eps: float = 1e-6
    offset: float = 0.0
    weight_in_float: bool = False


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def table(stages: list[Stage]) -> _Chain:
    """The kernel's parameter block for ``stages`` (checked: shapes, contiguous rows, the first ADD_NORM's
    residual given)."""
    if not 1 <= len(stages) <= MAX_STAGES:
        raise ValueError(f"a chain has 1..{MAX_STAGES} stages, got {len(stages)}")
    c = _Chain(count=len(stages))
    summed = False

    def rows16(t: torch.Tensor | None, what: str) -> None:  # the kernel's 16-byte loads and stores
        if t is not None and (t.data_ptr() % 16 or t.stride(-1) != 1 or (t.dim() > 1 and t.stride(0) % 8)):
            raise ValueError(f"stage {j}: {what} rows must be contiguous and 16-byte aligned")

    for j, s in enumerate(stages):
        n, kt = s.codes.shape[0] * 16, s.codes.shape[1]
        k = kt * 64
        if s.y.stride(-1) != 1 or s.y.shape[-1] > n or s.y.stride(0) != s.y.shape[-1]:
            raise ValueError(f"stage {j}: y must be contiguous [m, N]")
        width = 2 * k if s.kind == SILU_MUL else k
        if s.inp.stride(-1) != 1 or s.inp.shape[-1] < width or s.inp.stride(0) % 2:
            raise ValueError(f"stage {j}: input rows of {width} contiguous elements expected")
        for t, what in ((s.inp, "input"), (s.resid, "residual"), (s.resid_out, "sum"), (s.norm_out, "norm"),
                        (s.norm_w, "norm weight")):
            rows16(t, what)
        if s.kind == ADD_NORM:
            if s.resid is None and not summed:
                raise ValueError(f"stage {j}: the first residual add needs its residual")
            if s.norm_w is None or s.norm_w.numel() != k:
                raise ValueError(f"stage {j}: RMSNorm weight of {k} elements expected")
            summed = True
        c.st[j] = _Stage(_ptr(s.codes), _ptr(s.scales), _ptr(s.bias), _ptr(s.y), _ptr(s.inp), _ptr(s.resid),
                         _ptr(s.resid_out), _ptr(s.norm_out), _ptr(s.norm_w), s.inp.stride(0),
                         s.resid.stride(0) if s.resid is not None else 0, s.y.shape[-1], kt, s.kind,
                         int(s.weight_in_float), s.eps, s.offset)
    return c


def lib(device: torch.device) -> ctypes.CDLL | None:
    """The compiled chain kernel for ``device`` (bound), or None: no nvcc, CUDA kernels off, or before sm_90."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (9, 0):
        return None
    lb = cuda.load("q4_chain", device)
    if lb is not None and not getattr(lb, "_bound_q4_chain", False):
        cuda.bind(lb, "q4_chain", [_I, _I, _I, _P, _I, _P, _P, _P], len(CONFIGS))
        lb.q4_chain_stage_bytes.restype = _I
        if lb.q4_chain_stage_bytes() != ctypes.sizeof(_Stage):
            raise RuntimeError("q4_chain.cu's Stage and its ctypes mirror differ")
    return lb


_sync: dict[torch.device, torch.Tensor] = {}


def sync_words(device: torch.device) -> torch.Tensor | None:
    """The grid barrier's two counters on ``device`` (zero; the kernel leaves them zero), made outside a capture
    (None inside one, before they exist)."""
    if device not in _sync:
        if torch.cuda.is_current_stream_capturing():
            return None
        with torch.inference_mode(False):
            _sync[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return _sync[device]


def run(lb: ctypes.CDLL, stages: list[Stage], m: int, cfg: int, sync: torch.Tensor,
        trace: torch.Tensor | None = None) -> None:
    """Launch the chain (``m`` activation rows) on the current stream with launch config ``cfg``; ``trace``: int64
    [blocks, MAX_STAGES, 3] for per-block ns timestamps (stage start, prologue done, GEMV done)."""
    x = stages[0].inp
    c = table(stages)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    err = lb.q4_chain(x.device.index or 0, _DTYPE[x.dtype], cfg, ctypes.byref(c), m, sync.data_ptr(),
                      _ptr(trace), ctypes.c_void_p(stream))
    cuda.check(lb, "q4_chain", err)
