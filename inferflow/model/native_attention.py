"""Attention lowered into the native decode program (native_decode.py): the fused q/k/v projection, per-head q/k
RMSNorms, rotate-half RoPE from RoPE's own table, the K/V write, paged attention over the engine's cache in key
chunks (with their merge) and the output projection."""
from __future__ import annotations

from typing import Any

import torch

from .context import AttentionBackend, ForwardContext
from .native_lowering import ATT_CHUNKS, CACHE_DT, DT, MAX_ROWS, Unsupported, Val, label, name_of


class AttentionLowering:
    """NativeDecoder's attention steps (a mixin: it uses the decoder's program, buffers and linears)."""

    def _attention(self, m: Any, x: Val, tag: str) -> Val:
        if m.cross or not m.causal or m.softcap is not None or m.clip_qkv is not None:
            raise Unsupported(f"{tag}: attention features")
        if m.q_norm is not None and not (m.qk_norm_per_head and all(
                name_of(n) == "rmsnorm" and "fused_pending" not in n.__dict__ and n.weight.dtype in DT
                and tuple(n.weight.shape) == (m.d,) for n in (m.q_norm, m.k_norm))):
            raise Unsupported(f"{tag}: q/k norms other than per-head RMSNorm")
        st = self.cache._dev.get(m.cache_key)
        if st is None or st.k.device.type != "cpu" or not (
                st.k.dtype in (self.dtype, torch.float8_e4m3fn, torch.int8)
                or (st.k.dtype == torch.bfloat16 and self.dt == 0)):
            raise Unsupported(f"{tag}: no plain CPU K/V layer (the model's dtype, bfloat16 under float32, float8, int8)")
        h, hkv, d = m.h, m.hkv, m.d
        qd, kvd = m.qd, m.kvd
        rope = self.stack.position if m.use_position else None
        if rope is None or not (name_of(rope) == "rope" and rope.style == "half" and rope.dim == d
                                and rope.kind != "dynamic"):
            raise Unsupported(f"{tag}: position encoding other than rotate-half RoPE over whole heads")
        if not m.fused:
            raise Unsupported(f"{tag}: separate q/k/v projections (the engine fuses them: fuse_projections)")
        qkv = self._linear(m.qkv_proj, x, tag + ".qkv")
        heads = self._buf((h + hkv) * d, tag + ".heads")  # rotated q | k heads [M, H + Hkv, D]
        src, sxn = qkv.t.data_ptr(), qkv.ld
        if m.q_norm is not None:  # per-head RMSNorms into the heads buffer, rotated there in place
            for norm, first, count in ((m.q_norm, 0, h), (m.k_norm, h, hkv)):
                self.prog.add("head_rmsnorm", label(tag) + ".qk_norm", x=qkv.at(first * d), w=norm.weight,
                              y=heads.data_ptr() + first * d * heads.element_size(), sx=qkv.ld, sy=(h + hkv) * d,
                              per=count, D=d, dt=self.dt, wdt=DT[norm.weight.dtype],
                              wif=int(norm.weight_in_float or self.dt == 0), lanes=8, eps=norm.eps,
                              offset=norm.offset)
            src, sxn = heads.data_ptr(), (h + hkv) * d
        self._ropes.append(self.prog.add("rope", label(tag), x=src, out=heads, sxn=sxn, sxh=d, H=h + hkv, D=d,
                                         dt=self.dt))
        out = self._buf(qd, tag + ".attn")
        es = heads.element_size()
        part = torch.empty(MAX_ROWS * ATT_CHUNKS * h * (d + 2))  # each (row, key chunk, head)'s softmax partials
        self._keep.append(part)
        args = dict(q=heads, knew=heads.data_ptr() + h * d * es, vnew=qkv.at(qd + kvd), kc=st.k, vc=st.v, out=out,
                    part=part, sq=(h + hkv) * d, skn=(h + hkv) * d, svn=qkv.ld, H=h, Hkv=hkv, D=d,
                    bs=self.cache.block_size, dt=self.dt, cdt=CACHE_DT[st.k.dtype], win=m.window or 0, scale=m.scale)
        if st.ks is not None:  # int8 rows' scales, written with the rows and read by the attention
            args.update(ks=st.ks, vs=st.vs)
        self.prog.add("kv_write", label(tag), **args)
        self.prog.add("attention", label(tag), **args)
        self.prog.add("attn_merge", label(tag), **args)
        return self._linear(m.o_proj, Val(out, qd, qd), tag + ".o")

    def _rope_tables(self, need: int) -> None:
        """Point the rope ops at RoPE's cos/sin table, grown to cover position ``need - 1``."""
        rope = self.stack.position
        tab = getattr(rope, "_tab", None)
        if tab is None or tab[0] < need or tab[1] != self.dtype:
            ctx = ForwardContext(positions=torch.tensor([need - 1]), q_lens=[1], k_lens=[need],
                                 backend=AttentionBackend())
            rope._table(ctx, self.dtype)
            tab = rope._tab
        if tab is not self._rope_tab:
            for a in self._ropes:
                a.cos, a.sin = tab[2].data_ptr(), tab[3].data_ptr()
            self._rope_tab = tab
