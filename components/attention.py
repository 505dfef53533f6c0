"""Multi-head attention: MHA/GQA/MQA, fused or separate qkv, any bias pattern, q/k norm, causal or
bidirectional, cross-attention, scale override, logit soft-cap and sliding window.

Position encodings come from the stack (``ctx.position``): RoPE rotates q/k here, ALiBi and T5
relative buckets add a bias. K/V storage and the attention kernel belong to ``ctx.backend``.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from inferflow.component import Component
from inferflow.native import cpu_ops
from inferflow.registry import create, register


def _native_rope(pos, heads, ctx):
    """q|k heads [N, H + Hkv, D] rotated by one native call from RoPE's cos/sin table (inferflow/native/cpu_ops.py:
    the same bits as ``rotate_heads``); None where only RoPE itself serves."""
    if not (cpu_ops.enabled_all() and hasattr(pos, "_table") and pos._tabled(heads, ctx)):
        return None
    cos, ssin = pos._table(ctx, heads.dtype)
    return cpu_ops.rope(heads, cos, ssin)


@register("attention")
class Attention(Component):
    uses_kv_cache = True

    @dataclass(slots=True)
    class Params:
        hidden_size: int
        num_heads: int
        num_kv_heads: int | None = None
        head_dim: int | None = None
        qkv: str = "separate"          # "separate" (q_proj, k_proj, v_proj) or "fused" (qkv_proj: Q | K | V rows)
        bias: bool = False             # q/k/v biases
        out_bias: bool | None = None   # o_proj bias (default: same as bias)
        causal: bool = True
        cross: bool = False            # keys/values from the encoder output
        kv_input_size: int | None = None
        scale: float | None = None     # default 1/sqrt(head_dim)
        softcap: float | None = None
        clip_qkv: float | None = None  # clamp q/k/v projections to [-clip, clip] (MPT, DBRX, OLMo)
        sliding_window: int | None = None
        qk_norm: str | None = None     # "rmsnorm" or "layernorm"
        qk_norm_per_head: bool = True  # normalise each head (Qwen3) or the whole projection (OLMo2)
        qk_norm_eps: float = 1e-6
        use_position: bool = True

    def __init__(self, p: Params):
        super().__init__()
        if p.qkv not in ("separate", "fused"):
            raise ValueError(f"qkv must be 'separate' or 'fused', got {p.qkv!r}")
        self.h = p.num_heads
        self.hkv = p.num_kv_heads or p.num_heads
        self.d = p.head_dim or p.hidden_size // p.num_heads
        self.qd, self.kvd = self.h * self.d, self.hkv * self.d
        self.causal, self.cross, self.fused = p.causal, p.cross, p.qkv == "fused"
        self.scale = p.scale if p.scale is not None else 1.0 / math.sqrt(self.d)
        self.clip_qkv = p.clip_qkv
        self.softcap, self.window, self.use_position = p.softcap, p.sliding_window, p.use_position and not p.cross
        self.cache_key = id(self)
        kv_in = p.kv_input_size or p.hidden_size
        lin = lambda i, o, b: create("linear", {"in_features": i, "out_features": o, "bias": b})  # noqa: E731
        if self.fused and not p.cross:
            self.qkv_proj = lin(p.hidden_size, self.qd + 2 * self.kvd, p.bias)
        else:
            self.q_proj = lin(p.hidden_size, self.qd, p.bias)
            self.k_proj = lin(kv_in, self.kvd, p.bias)
            self.v_proj = lin(kv_in, self.kvd, p.bias)
        self.o_proj = lin(self.qd, p.hidden_size, p.bias if p.out_bias is None else p.out_bias)
        self.qk_norm_per_head = p.qk_norm_per_head
        if p.qk_norm:
            qdim, kdim = (self.d, self.d) if p.qk_norm_per_head else (self.qd, self.kvd)
            self.q_norm = create(p.qk_norm, {"dim": qdim, "eps": p.qk_norm_eps})
            self.k_norm = create(p.qk_norm, {"dim": kdim, "eps": p.qk_norm_eps})
        else:
            self.q_norm = self.k_norm = None

    def fusable_projections(self):
        """q/k/v read the same input: one fused GEMM after loading (inferflow/model/fuse.py)."""
        from inferflow.model.fuse import out_rows  # float or block-quantized weights alike

        rows = [out_rows(getattr(self, n, None)) for n in ("q_proj", "k_proj", "v_proj")]
        if self.fused or self.cross or rows != [self.qd, self.kvd, self.kvd]:
            return []
        return [("qkv_proj", ["q_proj", "k_proj", "v_proj"], lambda _: setattr(self, "fused", True))]

    def _norm(self, norm, t, heads):
        if norm is None:
            return t.view(t.shape[0], heads, self.d)
        if self.qk_norm_per_head:
            return norm(t.view(t.shape[0], heads, self.d))
        return norm(t).view(t.shape[0], heads, self.d)

    def forward(self, x, ctx):
        n = x.shape[0]
        if self.cross:
            q = self._norm(self.q_norm, self.q_proj(x), self.h)

            def compute():
                enc = ctx.encoder_out
                k = self._norm(self.k_norm, self.k_proj(enc), self.hkv)
                return k, self.v_proj(enc).view(enc.shape[0], self.hkv, self.d)

            kv = ctx.backend.cross_kv(self.cache_key, compute, ctx)
            out = ctx.backend.cross_attention(self.cache_key, q, kv, ctx, scale=self.scale, softcap=self.softcap)
            return self.o_proj(out.reshape(n, self.qd))
        if self.fused:
            qkv = self.qkv_proj(x)
            pos = ctx.position if self.use_position else None
            if self.q_norm is None and self.clip_qkv is None and hasattr(pos, "rotate_heads"):
                # q and k heads are adjacent in the fused output: rotate them as one [N, H + Hkv, D] tensor
                heads = qkv[:, :self.qd + self.kvd].view(n, self.h + self.hkv, self.d)
                qk = _native_rope(pos, heads, ctx) if heads.device.type == "cpu" else None
                if qk is None:
                    qk = pos.rotate_heads(heads, ctx)
                if qk is not None:
                    return self._attend(qk[:, :self.h], qk[:, self.h:], qkv[:, self.qd + self.kvd:].view(
                        n, self.hkv, self.d), ctx, pos)
            if self.q_norm is not None and self.clip_qkv is None:
                # a decode step's backend may run q/k norms, RoPE and attention as one kernel (static_decode.py)
                attend = getattr(ctx.backend, "norm_rope_attention", None)
                out = attend(self, qkv, ctx) if attend is not None else None
                if out is not None:
                    return self.o_proj(out.reshape(n, self.qd))
            q, k, v = qkv.split([self.qd, self.kvd, self.kvd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        qk = None
        # q/k norms + RoPE as one kernel on CUDA (inferflow/model/fused_qk_rope.py; "force": tests on the CPU)
        if self.fused and self.q_norm is not None and (q.is_cuda
                                                       or os.environ.get("INFERFLOW_FUSE_QK_ROPE") == "force"):
            from inferflow.model import fused_qk_rope

            if fused_qk_rope.wanted(q):
                qk = fused_qk_rope.norm_rope(self, q, k, ctx, v)  # v: stored in the cache too, where it can be
        if qk is None:
            q, k = self._norm(self.q_norm, q, self.h), self._norm(self.k_norm, k, self.hkv)
        else:
            q, k = qk
        v = v.view(n, self.hkv, self.d)
        pos = ctx.position if self.use_position else None
        if pos is not None and hasattr(pos, "rotate") and qk is None:
            q, k = pos.rotate(q, k, ctx)
        return self._attend(q, k, v, ctx, pos)

    def _attend(self, q, k, v, ctx, pos):
        """Attention of rotated q [N, H, D] over k, v [N, Hkv, D] (stored by the backend), through o_proj."""
        bias_fn = pos.bias_fn(ctx, self.causal) if pos is not None and hasattr(pos, "bias_fn") else None
        out = ctx.backend.self_attention(self.cache_key, q, k, v, ctx, causal=self.causal, scale=self.scale,
                                         window=self.window, softcap=self.softcap, bias_fn=bias_fn)
        return self.o_proj(out.reshape(q.shape[0], self.qd))
