"""The paged KV cache's write of new tokens' K and V as ONE kernel (CUDA, through Triton).

``PagedKVCache.write`` stores K and V with two ``index_copy_`` calls (plus dtype casts when the store dtype
differs): at decode sizes each is a tiny kernel, per layer. This copies both in one launch, same values (a copy,
or the same round-to-nearest cast ``.to`` does). An int8 cache's write (``write_kv_int8``) quantizes in the same
launch, with ``kv_store.quantize_int8``'s arithmetic and roundings (identical codes and scales), where torch takes
about a dozen kernels per layer. Used only for CUDA tensors by the cache (the tests call it on CPU
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


    @triton.jit
    def q8_scale(amax):
        """kv_store.quantize_int8's row scale from a row's absmax (float32): absmax * float32(1 / 127), 1 for an
        all-zero row."""
        s = amax * 0.007874015718698502  # float32(1 / 127), exactly
        return tl.where(s > 0, s, 1.0)

    @triton.jit
    def q8_codes(x, s):
        """kv_store.quantize_int8's codes of float32 ``x`` under its row's scale ``s`` (broadcast): x / s correctly
        rounded (as torch divides), then rounded half to even."""
        # |x / s| <= 127: adding and removing 1.5 * 2^23 rounds to the nearest integer, ties to even
        y = (tl.math.div_rn(x, s) + 12582912.0) - 12582912.0
        return tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8)

    @triton.jit
    def _q8_rows(X, XC, XS, n, sx, slot, offs_h, offs_d, mask, HKV: tl.constexpr, D: tl.constexpr):
        """Token ``n``'s [Hkv, D] rows of X as int8 codes at ``slot`` of XC and their float32 scales in XS."""
        x = tl.load(X + n * sx + offs_h[:, None] * D + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        s = q8_scale(tl.max(tl.abs(x), 1))
        tl.store(XC + slot * (HKV * D) + offs_h[:, None] * D + offs_d[None, :], q8_codes(x, s[:, None]), mask=mask)
        tl.store(XS + slot * HKV + offs_h, s, mask=offs_h < HKV)

    @triton.jit
    def _kv_write_int8(K, V, KC, VC, KS, VS, SLOTS, sk, sv, HKV: tl.constexpr, D: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        n = tl.program_id(0)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)
        slot = tl.load(SLOTS + n).to(tl.int64)
        _q8_rows(K, KC, KS, n, sk, slot, offs_h, offs_d, mask, HKV, D)
        _q8_rows(V, VC, VS, n, sv, slot, offs_h, offs_d, mask, HKV, D)


def _rows_ok(x: torch.Tensor) -> bool:
    # each token's [Hkv, D] contiguous (a view into a fused qkv output is fine: only the token stride is free)
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _fits(kf: torch.Tensor, vf: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (_state["ok"] and k.shape == v.shape and k.dim() == 3 and kf.shape[1:] == k.shape[1:]
            and vf.shape == kf.shape and kf.is_contiguous() and vf.is_contiguous() and _rows_ok(k) and _rows_ok(v)
            and slots.dim() == 1 and slots.shape[0] == k.shape[0] and len({t.device for t in (kf, vf, slots, k, v)}) == 1
            and k.is_floating_point() and v.dtype == k.dtype and vf.dtype == kf.dtype)


def _run(launch) -> bool:
    try:
        launch()
    except Exception as e:  # noqa: BLE001 - any compile/launch failure: index_copy_ from now on
        _state["ok"] = False
        warnings.warn(f"fused KV-cache write kernel failed ({type(e).__name__}: {e}); using index_copy_ "
                      f"(set {ENV}=0 to skip it)", RuntimeWarning, stacklevel=3)
        return False
    return True


def write_kv(kf: torch.Tensor, vf: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """``kf[slots] = k; vf[slots] = v`` (flat stores [S, Hkv, D], contiguous) in one kernel; False: not served."""
    if not (_fits(kf, vf, slots, k, v) and kf.is_floating_point()):
        return False
    N, row = k.shape[0], k.shape[1] * k.shape[2]
    if N == 0:
        return True
    BLOCK = min(triton.next_power_of_2(row), 2048)
    return _run(lambda: _kv_write[(N, triton.cdiv(row, BLOCK))](k, v, kf, vf, slots, k.stride(0), v.stride(0),
                                                                ROW=row, BLOCK=BLOCK))


def write_kv_int8(kf: torch.Tensor, vf: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, slots: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor) -> bool:
    """An int8 cache's ``kf[slots], ks[slots] = quantize_int8(k)`` and the same for v (flat stores [S, Hkv, D] and
    float32 scales [S, Hkv], contiguous) in one kernel; False: not served."""
    if not (_fits(kf, vf, slots, k, v) and kf.dtype == torch.int8 and ks.dtype == vs.dtype == torch.float32
            and ks.shape == vs.shape == kf.shape[:2] and ks.is_contiguous() and vs.is_contiguous()
            and ks.device == kf.device):
        return False
    N, hkv, d = k.shape
    if N == 0:
        return True
    return _run(lambda: _kv_write_int8[(N,)](k, v, kf, vf, ks, vs, slots, k.stride(0), v.stride(0), HKV=hkv, D=d,
                                             BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d)))
