"""Per-head q-norm, k-norm and rotate-half RoPE of a fused q|k|v projection output as ONE kernel (CUDA, Triton).

Attention with per-head RMSNorm on q and k (and a rotate-half RoPE) runs four small kernels per layer on the
projection output (q norm, k norm, q rope, k rope); this is one launch over every q and k head of every token,
with the torch composition's roundings: the norm's output rounded to the dtype (as ``RMSNorm`` returns it), then
RoPE's products and sum each rounded (as ``fused_ops.rope_half``). Used by attention for CUDA tensors
(``INFERFLOW_FUSE_QK_ROPE=force``: CPU tensors too, for tests under ``TRITON_INTERPRET=1``); ``=0`` turns it off;
a kernel failure warns once and leaves the separate ops in charge for good.

Two grids: one program per (token, head) for decode-sized calls (a step's few tokens: many small programs fill the
GPU), one per token over all its heads for prefill-sized ones (``ROWS_MIN`` tokens and up): there the per-head grid
was 327k programs of 64-element halves for 4 x 2048 tokens, each reloading the row's cos / sin, and took 6.5% of an
8192-token prefill on an H200 (12.9 of 196 GPU ms, docs/benchmarks.md).

In the static decode step (CUDA graphs) the same launch also stores the roped k and the v heads at their paged-cache
slots (the cache's ``claim_write``), which saves the cache write's own kernel per layer (triton_kv_write.py);
``INFERFLOW_FUSE_KV_WRITE=0`` keeps that write separate.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

ENV = "INFERFLOW_FUSE_QK_ROPE"
KV_ENV = "INFERFLOW_FUSE_KV_WRITE"  # =0: the cache write stays a kernel of its own (triton_kv_write.py)
ROWS_MIN = 64  # tokens from which one program takes all of a token's heads (prefill); fewer: one per head
_state = {"ok": triton is not None}


def wanted(x: torch.Tensor) -> bool:
    return _state["ok"] and os.environ.get(ENV, "1") != "0" and (x.is_cuda or os.environ.get(ENV) == "force")


if triton is not None:
    from ..engine.triton_kv_write import q8_codes, q8_scale

    @triton.jit
    def norm_rope_halves(x1, x2, rstd, w1, w2, c1, c2, s1, s2, offset, dt: tl.constexpr,
                         WEIGHT_IN_FLOAT: tl.constexpr, HAS_OFFSET: tl.constexpr):
        """The two halves (o1, o2, in ``dt``) of heads normalized and rotated: float32 halves x1, x2 of the input,
        their ``rstd``, the norm weight's halves w1, w2 and the position's cos / sin halves (all broadcastable),
        with the torch composition's roundings (the module doc). Also the fused attention's (triton_attention)."""
        if HAS_OFFSET:
            w1 = w1 + offset
            w2 = w2 + offset
        if WEIGHT_IN_FLOAT:
            y1 = (x1 * rstd * w1).to(dt).to(tl.float32)
            y2 = (x2 * rstd * w2).to(dt).to(tl.float32)
        else:  # torch: w.to(dtype) * h.to(dtype)
            if HAS_OFFSET:
                w1 = w1.to(dt).to(tl.float32)
                w2 = w2.to(dt).to(tl.float32)
            y1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            y2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        o1 = ((y1 * c1).to(dt).to(tl.float32) + (-y2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((y2 * c2).to(dt).to(tl.float32) + (y1 * s2).to(dt).to(tl.float32)).to(dt)
        return o1, o2

    @triton.jit
    def _head_out(x1, x2, rstd, is_q, WQ, WK, CR, SR, i, offset, HALF: tl.constexpr, dt: tl.constexpr,
                  WEIGHT_IN_FLOAT: tl.constexpr, HAS_OFFSET: tl.constexpr):
        """norm_rope_halves for q heads (``is_q``) or k heads, with their norm weight and the row's cos / sin
        (``CR``, ``SR``) loaded at columns ``i`` (any shape that broadcasts against the halves)."""
        w1 = tl.where(is_q, tl.load(WQ + i), tl.load(WK + i)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(WQ + HALF + i), tl.load(WK + HALF + i)).to(tl.float32)
        c1 = tl.load(CR + i).to(tl.float32)
        c2 = tl.load(CR + HALF + i).to(tl.float32)
        s1 = tl.load(SR + i).to(tl.float32)
        s2 = tl.load(SR + HALF + i).to(tl.float32)
        return norm_rope_halves(x1, x2, rstd, w1, w2, c1, c2, s1, s2, offset, dt, WEIGHT_IN_FLOAT, HAS_OFFSET)

    @triton.jit
    def _qk_norm_rope(QKV, WQ, WK, C, S, QO, KO, sx, sc, H, HKV, eps, offset, SLOTS, KC, VC, KS, VS,
                      HALF: tl.constexpr, WEIGHT_IN_FLOAT: tl.constexpr, HAS_OFFSET: tl.constexpr,
                      WRITE_KV: tl.constexpr, QUANT: tl.constexpr):
        r = tl.program_id(0)
        if WRITE_KV:  # q heads, k heads, then v heads (each copied to its cache slot)
            n = r // (H + 2 * HKV)
            h = r % (H + 2 * HKV)
        else:
            n = r // (H + HKV)
            h = r % (H + HKV)  # q heads then k heads: head h starts at h * D in the q|k|v row
        i = tl.arange(0, HALF)
        base = QKV + n * sx + h * 2 * HALF
        if h < H + HKV:
            is_q = h < H
            x1 = tl.load(base + i).to(tl.float32)
            x2 = tl.load(base + HALF + i).to(tl.float32)
            rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
            o1, o2 = _head_out(x1, x2, rstd, is_q, WQ, WK, C + n * sc, S + n * sc, i, offset, HALF,
                               QO.dtype.element_ty, WEIGHT_IN_FLOAT, HAS_OFFSET)
            qrow = tl.minimum(h, H - 1)
            krow = tl.maximum(h - H, 0)
            qo = QO + (n * H + qrow) * 2 * HALF
            ko = KO + (n * HKV + krow) * 2 * HALF
            qm = i < tl.where(is_q, HALF, 0)  # all-true for a q head, all-false for a k head
            km = i < tl.where(is_q, 0, HALF)
            tl.store(qo + i, o1, mask=qm)
            tl.store(qo + HALF + i, o2, mask=qm)
            tl.store(ko + i, o1, mask=km)
            tl.store(ko + HALF + i, o2, mask=km)
            if WRITE_KV:  # the roped k head into its cache slot too (same value, cast as the cache write does)
                _store_head(KC, KS, tl.load(SLOTS + n).to(tl.int64) * HKV + krow, o1, o2, i, h >= H, HALF, QUANT)
        else:
            _store_head(VC, VS, tl.load(SLOTS + n).to(tl.int64) * HKV + (h - H - HKV), tl.load(base + i),
                        tl.load(base + HALF + i), i, True, HALF, QUANT)

    @triton.jit
    def _store_head(XC, XS, row, x1, x2, i, live, HALF: tl.constexpr, QUANT: tl.constexpr):
        """A head's halves into cache row ``row`` (only where ``live``): cast as the cache's write casts, or QUANT
        (an int8 cache) as its write quantizes them, codes and the row's scale."""
        m = i < tl.where(live, HALF, 0)
        if QUANT:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            s = q8_scale(tl.maximum(tl.max(tl.abs(f1), 0), tl.max(tl.abs(f2), 0)))
            tl.store(XC + row * 2 * HALF + i, q8_codes(f1, s), mask=m)
            tl.store(XC + row * 2 * HALF + HALF + i, q8_codes(f2, s), mask=m)
            tl.store(XS + row, s, mask=live)
        else:
            tl.store(XC + row * 2 * HALF + i, x1.to(XC.dtype.element_ty), mask=m)
            tl.store(XC + row * 2 * HALF + HALF + i, x2.to(XC.dtype.element_ty), mask=m)


if triton is not None:
    @triton.jit
    def _qk_norm_rope_rows(QKV, WQ, WK, C, S, QO, KO, sx, sc, H, HKV, eps, offset, HALF: tl.constexpr,
                           BLOCK_H: tl.constexpr, WEIGHT_IN_FLOAT: tl.constexpr, HAS_OFFSET: tl.constexpr):
        """_qk_norm_rope for one token's q and k heads at once ([BLOCK_H, HALF] tiles): cos / sin and the norm
        weights loaded once per token; the same per-head arithmetic."""
        n = tl.program_id(0)
        hh = tl.arange(0, BLOCK_H)[:, None]
        i = tl.arange(0, HALF)[None, :]
        live = hh < H + HKV
        base = QKV + n * sx + hh * 2 * HALF
        x1 = tl.load(base + i, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + i, mask=live, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1))[:, None] / (2 * HALF) + eps)
        is_q = hh < H
        o1, o2 = _head_out(x1, x2, rstd, is_q, WQ, WK, C + n * sc, S + n * sc, i, offset, HALF,
                           QO.dtype.element_ty, WEIGHT_IN_FLOAT, HAS_OFFSET)
        qm = is_q & (i < HALF)
        km = live & (hh >= H) & (i < HALF)
        qo = QO + (n * H + hh) * 2 * HALF
        ko = KO + (n * HKV + (hh - H)) * 2 * HALF
        tl.store(qo + i, o1, mask=qm)
        tl.store(qo + HALF + i, o2, mask=qm)
        tl.store(ko + i, o1, mask=km)
        tl.store(ko + HALF + i, o2, mask=km)


def _cache_target(attn: Any, ctx: Any, ko: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """(slots, flat K store, flat V store, and for an int8 cache its K and V row scales) when this step's backend is
    one whose ``cache`` and per-row ``slots`` take the new K/V as they are (the static decode step,
    static_decode.py), claimed from the cache (the backend's own write of ``ko`` is then skipped); None: the
    backend writes K/V itself."""
    be = ctx.backend
    cache, slots, key = getattr(be, "cache", None), getattr(be, "slots", None), getattr(attn, "cache_key", None)
    if (os.environ.get(KV_ENV, "1") == "0" or key is None or not hasattr(cache, "claim_write")
            or not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.shape[0] != ko.shape[0]
            or not cache.has_layer(key)):
        return None
    stores = cache.claim_write(key, slots, ko)
    if stores is None:
        return None
    kf, vf = stores
    scales = cache.scale_stores(key) or ()
    if not (kf.is_contiguous() and vf.is_contiguous() and kf.shape[1:] == ko.shape[1:] and vf.shape == kf.shape
            and (kf.is_floating_point() or (kf.dtype == torch.int8 and all(t.is_contiguous() for t in scales)
                                            and len(scales) == 2)) and vf.dtype == kf.dtype):
        cache.release_claim()
        return None
    return slots, kf, vf, *scales


def cos_sin(attn: Any, q: torch.Tensor, k: torch.Tensor, ctx: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rows' RoPE (cos, sin) [N, 1, D] where the one-kernel pattern holds for these q and k parts of a fused
    q|k|v output (per-head RMSNorms alike, rotate-half RoPE, k right after q in each row); None where it does not."""
    pos = ctx.position if getattr(attn, "use_position", False) else None
    qn, kn, d = attn.q_norm, attn.k_norm, attn.d
    if (pos is None or getattr(pos, "style", None) != "half" or getattr(pos, "dim", None) != d
            or hasattr(pos, "bias_fn")
            or not attn.qk_norm_per_head or getattr(qn, "component_name", None) != "rmsnorm"
            or getattr(kn, "component_name", None) != "rmsnorm" or (qn.eps, qn.offset, qn.weight_in_float)
            != (kn.eps, kn.offset, kn.weight_in_float) or d % 2 or (d // 2) & (d // 2 - 1)
            or q.dim() != 2 or q.stride(-1) != 1 or k.stride(0) != q.stride(0)
            or k.data_ptr() != q.data_ptr() + q.shape[1] * q.element_size()  # k right after q in each row
            or qn.weight.dtype != q.dtype or kn.weight.dtype != q.dtype):
        return None
    cos, sin = pos.cos_sin(ctx, q.dtype)
    if cos.shape[-1] != d or cos.stride(-1) != 1 or sin.stride() != cos.stride() or cos.dtype != q.dtype:
        return None
    return cos, sin


def norm_rope(attn: Any, q: torch.Tensor, k: torch.Tensor, ctx: Any,
              v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q [N, H, D] and k [N, Hkv, D], normalized per head and rotated, from the q and k parts of a fused q|k|v
    output; None when the pattern does not hold (the caller runs the separate ops). With ``v`` (the row's v part)
    and a backend whose cache takes them (``_cache_target``), k and v are also stored in the paged cache."""
    cs = cos_sin(attn, q, k, ctx)
    if cs is None:
        return None
    cos, sin = cs
    qn, kn, d, h, hkv = attn.q_norm, attn.k_norm, attn.d, attn.h, attn.hkv
    N = q.shape[0]
    qo = torch.empty((N, h, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((N, hkv, d), dtype=q.dtype, device=q.device)
    target = None
    if (v is not None and N and v.dim() == 2 and v.shape[1] == hkv * d and v.stride() == k.stride()
            and v.data_ptr() == k.data_ptr() + k.shape[1] * k.element_size()):  # v right after k in each row
        target = _cache_target(attn, ctx, ko)
    if N:
        slots, kf, vf, *scales = target if target is not None else (ko, ko, ko)  # unused pointers when not writing
        ks, vs = scales or (ko, ko)
        flags = dict(WEIGHT_IN_FLOAT=bool(qn.weight_in_float), HAS_OFFSET=bool(qn.offset))
        try:
            if target is None and N >= ROWS_MIN:
                _qk_norm_rope_rows[(N,)](q, qn.weight, kn.weight, cos, sin, qo, ko, q.stride(0), cos.stride(0), h,
                                         hkv, float(qn.eps), float(qn.offset), HALF=d // 2,
                                         BLOCK_H=triton.next_power_of_2(h + hkv), **flags)
            else:
                _qk_norm_rope[(N * (h + hkv + (hkv if target is not None else 0)),)](
                    q, qn.weight, kn.weight, cos, sin, qo, ko, q.stride(0), cos.stride(0), h, hkv, float(qn.eps),
                    float(qn.offset), slots, kf, vf, ks, vs, HALF=d // 2, WRITE_KV=target is not None,
                    QUANT=bool(scales), **flags)
        except Exception as e:  # noqa: BLE001 - any compile/launch failure: the separate ops from now on
            if target is not None:
                ctx.backend.cache.release_claim()
            _state["ok"] = False
            warnings.warn(f"fused q/k norm + RoPE kernel failed ({type(e).__name__}: {e}); using the separate ops "
                          f"(set {ENV}=0 to skip it)", RuntimeWarning, stacklevel=2)
            return None
    return qo, ko
