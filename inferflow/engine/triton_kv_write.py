"""The paged KV cache's write of new tokens' K and V as ONE kernel (CUDA, through Triton).

``PagedKVCache.write`` stores K and V with two ``index_copy_`` calls (plus dtype casts when the store dtype
differs): at decode sizes each is a tiny kernel, per layer. This copies both in one launch, same values (a copy,
or the same round-to-nearest cast ``.to`` does). Used only for CUDA tensors by the cache (the tests call it on CPU
tensors under ``TRITON_INTERPRET=1``); ``INFERFLOW_FUSE_KV_WRITE=0`` turns it off, and a kernel failure warns once
and leaves the two ``index_copy_`` calls in charge for good.
"""
from __future__ import annotations

import os
import warnings

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

ENV = "INFERFLOW_FUSE_KV_WRITE"
_state = {"ok": triton is not None and os.environ.get(ENV, "1") != "0"}


def enabled() -> bool:
    return _state["ok"]


if triton is not None:
    @triton.jit
    def _kv_write(K, V, KC, VC, SLOTS, sk, sv, ROW: tl.constexpr, BLOCK: tl.constexpr):
        n = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < ROW
        slot = tl.load(SLOTS + n).to(tl.int64)
        k = tl.load(K + n * sk + offs, mask=mask)
        v = tl.load(V + n * sv + offs, mask=mask)
        tl.store(KC + slot * ROW + offs, k.to(KC.dtype.element_ty), mask=mask)
        tl.store(VC + slot * ROW + offs, v.to(VC.dtype.element_ty), mask=mask)


def _rows_ok(x: torch.Tensor) -> bool:
    # each token's [Hkv, D] contiguous (a view into a fused qkv output is fine: only the token stride is free)
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def write_kv(kf: torch.Tensor, vf: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """``kf[slots] = k; vf[slots] = v`` (flat stores [S, Hkv, D], contiguous) in one kernel; False: not served."""
    if (not _state["ok"] or k.shape != v.shape or k.dim() != 3 or kf.shape[1:] != k.shape[1:]
            or vf.shape != kf.shape or not (kf.is_contiguous() and vf.is_contiguous())
            or not (_rows_ok(k) and _rows_ok(v))
            or slots.dim() != 1 or slots.shape[0] != k.shape[0] or len({t.device for t in (kf, vf, slots, k, v)}) != 1
            or not (k.is_floating_point() and kf.is_floating_point() and v.dtype == k.dtype and vf.dtype == kf.dtype)):
        return False
    N, row = k.shape[0], k.shape[1] * k.shape[2]
    if N == 0:
        return True
    BLOCK = min(triton.next_power_of_2(row), 2048)
    try:
        _kv_write[(N, triton.cdiv(row, BLOCK))](k, v, kf, vf, slots, k.stride(0), v.stride(0), ROW=row, BLOCK=BLOCK)
    except Exception as e:  # noqa: BLE001 - any compile/launch failure: index_copy_ from now on
        _state["ok"] = False
        warnings.warn(f"fused KV-cache write kernel failed ({type(e).__name__}: {e}); using index_copy_ "
                      f"(set {ENV}=0 to skip it)", RuntimeWarning, stacklevel=2)
        return False
    return True
