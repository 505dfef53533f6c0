"""The non-GEMV ops of a CPU decode step as one native call each (``cpu_ops.c``): RMSNorm, residual add + RMSNorm,
SiLU*mul, rotate-half RoPE, paged decode attention (the K/V cache write included) and greedy sampling's argmax.

Why: at decode sizes each of these is several torch ops of a few microseconds (dispatch, allocation, a thread-pool
wake-up): ~39 ops per layer besides the GEMVs on SmolLM2-135M, several milliseconds per token, as much as the GEMVs
once those are native. Each function returns None where it does not serve (a dtype other than float32/bfloat16, a
layout it does not take, native ops off): the caller then runs its torch path.

``$INFERFLOW_NATIVE_OPS``: unset (or ``1``), all of them: RMSNorm, add + RMSNorm (bit for bit the torch ops:
torch's summation order is reproduced), SiLU*mul (float rounding apart), RoPE (bit for bit) and the paged decode
attention (float32 softmax: float rounding apart from SDPA); ``norms``: only the first three; ``0`` none
(``INFERFLOW_NATIVE=0``: no native kernel at all). Every result is independent of the batch and the thread count (each output summed in a fixed order).
"""
from __future__ import annotations

import ctypes
import os

import torch

from . import load, threads

ENV = "INFERFLOW_NATIVE_OPS"
_DT = {torch.float32: 0, torch.bfloat16: 1}
# K/V caches: also float8 e4m3 (widened as read, rounded as torch's cast) and int8 with per-row scales
_CDT = {**_DT, torch.float8_e4m3fn: 2, torch.int8: 3}
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_state: dict[str, object] = {}


def _lib() -> ctypes.CDLL | None:
    if "lib" not in _state:
        lib = load("cpu_ops")
        if lib is not None:
            lib.cpu_rmsnorm.argtypes = [ctypes.c_int, _P, _I, _P, ctypes.c_int, _P, _I, _I, _F, _F, ctypes.c_int,
                                        ctypes.c_int, ctypes.c_int]
            lib.cpu_add_rmsnorm.argtypes = [ctypes.c_int, _P, _P, _P, ctypes.c_int, _P, _P, _I, _I, _F, _F,
                                            ctypes.c_int, ctypes.c_int, ctypes.c_int]
            lib.cpu_silu_mul.argtypes = [ctypes.c_int, _P, _I, _P, _I, _P, _I, _I, ctypes.c_int]
            lib.cpu_rope.argtypes = [ctypes.c_int, _P, _I, _I, _I, _I, _I, _P, _P, _I, _P]
            lib.cpu_paged_decode.argtypes = [ctypes.c_int, ctypes.c_int, _P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P, _P, _I, _P,
                                             _I, _I, _I,
                                             _I, _I, _F, _I, _P, ctypes.c_int]
            lib.cpu_argmax.argtypes = [_P, _I, _I, _I, _P]
            for f in (lib.cpu_rmsnorm, lib.cpu_add_rmsnorm, lib.cpu_silu_mul, lib.cpu_rope, lib.cpu_argmax):
                f.restype = None
            lib.cpu_paged_decode.restype = ctypes.c_int
        _state["lib"] = lib
    return _state["lib"]  # type: ignore[return-value]


def _mode() -> int:
    """0: off, 1: the ops that equal their torch paths bit for bit or nearly (RMSNorm, SiLU*mul), 2: all (default)."""
    mode = _state.get("mode")
    if mode is None:
        v = os.environ.get(ENV, "").strip().lower()
        mode = 0 if v in ("0", "false", "off", "no") else 1 if v == "norms" else 2
        _state["mode"] = mode = mode if _lib() is not None else 0
    return mode  # type: ignore[return-value]


def enabled() -> bool:
    """Whether RMSNorm and SiLU*mul run natively: unless ``$INFERFLOW_NATIVE_OPS=0`` (and the library builds here).
    Read once (a decode step asks ~100 times); ``refresh()`` after changing the variable."""
    return _mode() > 0


def enabled_all() -> bool:
    """Whether RoPE and the paged decode attention run natively too (unless ``$INFERFLOW_NATIVE_OPS`` is 0 or
    ``norms``)."""
    return _mode() > 1


def _lanes() -> int:
    """Floats per vector of torch's CPU sum kernel, whose summation order RMSNorm reproduces (bit for bit torch's
    ``x.pow(2).mean()``): 8 on x86 (the sum is dispatched to its AVX2 build even on AVX-512 machines, and the
    portable build's vectors are 256-bit too)."""
    return 8


def refresh() -> None:
    """Re-read ``$INFERFLOW_NATIVE_OPS`` (tests and benchmarks switch it within one process)."""
    _state.pop("mode", None)


# The per-call wrappers below are lean on purpose: at decode sizes their Python checks cost about as much as the
# kernel (a few attribute reads each); callers pass CPU tensors (they check the device before calling).

def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
            weight_in_float: bool = False) -> torch.Tensor | None:
    """RMSNorm over the last dim of CPU x [..., D] (2-D with any row stride, else contiguous) with a 1-D
    contiguous weight: components/norms.py's arithmetic in float32; None: not served."""
    dt, wdt = _DT.get(x.dtype), _DT.get(weight.dtype)
    if dt is None or wdt is None or not enabled():
        return None
    shape = x.shape
    D = shape[-1]
    if len(shape) == 2 and x.stride(1) == 1:
        rows, sx = shape[0], x.stride(0)
    elif x.is_contiguous():
        rows, sx = (x.numel() // D if D else 0), D
    else:
        return None
    if weight.shape != (D,) or weight.stride(0) != 1:
        return None
    y = torch.empty(shape, dtype=x.dtype)
    if rows:
        _lib().cpu_rmsnorm(dt, x.data_ptr(), sx, weight.data_ptr(), wdt, y.data_ptr(), rows, D, eps, offset,
                           1 if weight_in_float or dt == 0 else 0, _lanes(), threads())
    return y


def add_rmsnorm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                weight_in_float: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(a + b, rmsnorm(a + b))`` for same-shape contiguous CPU tensors in one call, bit for bit the torch add and
    components/norms.py's RMSNorm; None: not served."""
    dt, wdt = _DT.get(a.dtype), _DT.get(weight.dtype)
    shape = a.shape
    if (dt is None or wdt is None or b.dtype != a.dtype or b.shape != shape or not shape or not enabled()
            or a.device.type != "cpu" or b.device.type != "cpu" or weight.device.type != "cpu"
            or not (a.is_contiguous() and b.is_contiguous()) or weight.shape != shape[-1:]
            or weight.stride(0) != 1):
        return None
    D = shape[-1]
    s, y = torch.empty(shape, dtype=a.dtype), torch.empty(shape, dtype=a.dtype)
    rows = a.numel() // D if D else 0
    if rows:
        _lib().cpu_add_rmsnorm(dt, a.data_ptr(), b.data_ptr(), weight.data_ptr(), wdt, s.data_ptr(), y.data_ptr(),
                               rows, D, eps, offset, 1 if weight_in_float or dt == 0 else 0, _lanes(), threads())
    return s, y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for CPU [N, I] views with contiguous rows (e.g. the halves of a fused gate|up output);
    None: not served."""
    dt = _DT.get(gate.dtype)
    if (dt is None or up.dtype != gate.dtype or gate.shape != up.shape or gate.stride(1) != 1 or up.stride(1) != 1
            or not enabled()):
        return None
    N, I = gate.shape
    out = torch.empty((N, I), dtype=gate.dtype)
    if N and I:
        _lib().cpu_silu_mul(dt, gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(), N, I,
                            threads())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor) -> torch.Tensor | None:
    """``x * cos + roll(x, D/2) * ssin`` for CPU heads x [N, H, D] (last dim contiguous) with cos/ssin [N, 1, D]
    rows (components/rope.py's table form); the same bits as that torch composition. None: not served."""
    dt = _DT.get(x.dtype)
    if dt is None or cos.dtype != x.dtype or ssin.dtype != x.dtype or not enabled_all():
        return None
    shape, st, cst = x.shape, x.stride(), cos.stride()
    if len(shape) != 3:
        return None
    N, H, D = shape
    if (st[2] != 1 or D % 2 or D > 4096 or cos.shape != (N, 1, D) or ssin.shape != cos.shape or cst[2] != 1
            or ssin.stride() != cst or x.device.type != "cpu" or cos.device.type != "cpu"):
        return None
    out = torch.empty((N, H, D), dtype=x.dtype)
    if N and H:
        _lib().cpu_rope(dt, x.data_ptr(), st[0], st[1], N, H, D, cos.data_ptr(), ssin.data_ptr(), cst[0],
                        out.data_ptr())
    return out


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(-1)`` for a CPU float32 [rows, n] (n > 0, last dim contiguous): the same indices (first maximum;
    a NaN counts as the maximum), ~20x faster over a vocabulary row. None: not served."""
    if (x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu" or x.shape[1] == 0 or x.stride(1) != 1
            or not enabled()):
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        _lib().cpu_argmax(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out


class DecodeBatch:
    """A pure-decode batch's block tables int64 [B, W], key counts [B] (the new token included) and new-token slots
    [B], validated once per forward against a cache of ``num_blocks`` blocks of ``block_size`` (every key a
    sequence reads lies in a block of the cache), so the per-layer calls only check their own tensors."""

    __slots__ = ("tables", "lens", "slots", "block_size", "num_blocks", "B")

    def __init__(self, tables: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor, block_size: int,
                 num_blocks: int):
        B = lens.shape[0]
        if (tables.dtype != torch.int64 or lens.dtype != torch.int64 or slots.dtype != torch.int64
                or tables.dim() != 2 or tables.shape[0] != B or slots.shape != (B,) or lens.dim() != 1
                or any(t.device.type != "cpu" for t in (tables, lens, slots))):
            raise ValueError("DecodeBatch: int64 CPU tables [B, W], lens [B] and slots [B] expected")
        tables, lens, slots = tables.contiguous(), lens.contiguous(), slots.contiguous()
        nblk = (lens + block_size - 1) // block_size
        used = tables[torch.arange(tables.shape[1])[None, :] < nblk[:, None]]
        if B and (int(lens.min()) < 1 or int(nblk.max()) > tables.shape[1] or int(used.min()) < 0
                  or int(used.max()) >= num_blocks or int(slots.min()) < 0
                  or int(slots.max()) >= num_blocks * block_size):
            raise ValueError("DecodeBatch: lengths, block ids or slots outside the cache")
        self.tables, self.lens, self.slots, self.block_size, self.num_blocks, self.B = (
            tables, lens, slots, block_size, num_blocks, B)


def paged_decode(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kc: torch.Tensor,
                 vc: torch.Tensor, batch: DecodeBatch, scale: float, window: int | None = None,
                 k_scales: torch.Tensor | None = None, v_scales: torch.Tensor | None = None) -> torch.Tensor | None:
    """Decode attention of q [B, H, D] (heads contiguous) over the flat paged caches kc/vc [S, Hkv, D]
    (S = num_blocks * block_size, contiguous; q's dtype, bfloat16 under float32 q, or float8 e4m3), storing the new k/v [B, Hkv, D] (heads contiguous) at the batch's
    slots first (k None: already stored); ``window``: each query sees only its last ``window`` keys (itself
    included). An int8 cache takes its rows' float32 scales ``k_scales``/``v_scales`` [S, Hkv] (kv_store.quantize_int8's, which
    the new rows' quantization reproduces). Returns [B, H, D]; None: not served."""
    dt, cdt = _DT.get(q.dtype), _CDT.get(kc.dtype)
    # the cache in q's dtype, bfloat16 under float32 queries, or float8 (new K/V rounded as torch's .to())
    if (dt is None or cdt is None or (cdt != dt and dt != 0 and cdt < 2) or vc.dtype != kc.dtype
            or not enabled_all() or q.shape[-1] > 4096):
        return None
    if cdt == 3 and not all(s is not None and s.dtype == torch.float32 and s.is_contiguous()
                            and s.numel() == kc.shape[0] * kc.shape[1] for s in (k_scales, v_scales)):
        return None
    shape, qs, ks = q.shape, q.stride(), kc.shape
    if len(shape) != 3 or len(ks) != 3:
        return None
    B, H, D = shape
    hkv = ks[1]
    if (B != batch.B or qs[2] != 1 or qs[1] != D or ks[2] != D or H % hkv or vc.shape != ks
            or ks[0] != batch.num_blocks * batch.block_size or not kc.is_contiguous() or not vc.is_contiguous()
            or q.device.type != "cpu" or kc.device.type != "cpu"):
        return None
    kp = vp = None
    skn = svn = 0
    if k is not None:
        kst, vst = k.stride(), v.stride()
        if (k.dtype != q.dtype or v.dtype != q.dtype or k.shape != (B, hkv, D) or v.shape != k.shape
                or kst[1:] != (D, 1) or vst[1:] != (D, 1) or k.device.type != "cpu" or v.device.type != "cpu"):
            return None
        kp, vp, skn, svn = k.data_ptr(), v.data_ptr(), kst[0], vst[0]
    out = torch.empty((B, H, D), dtype=q.dtype)
    if B:
        t = batch.tables
        ksp, vsp = (None, None) if cdt != 3 else (k_scales.data_ptr(), v_scales.data_ptr())
        if _lib().cpu_paged_decode(dt, cdt, q.data_ptr(), qs[0], kp, skn, vp, svn, kc.data_ptr(), vc.data_ptr(), ksp, vsp,
                                   batch.slots.data_ptr(), t.data_ptr(), t.stride(0), batch.lens.data_ptr(), B, H,
                                   hkv, D, batch.block_size, scale, window or 0, out.data_ptr(), threads()):
            raise MemoryError("native paged decode attention: out of memory for its partial sums")
    return out
