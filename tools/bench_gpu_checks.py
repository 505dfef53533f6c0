"""The kernel checks of tools/bench_gpu.py: the Triton paged-decode kernel and the fused element-wise kernels
(RMSNorm, SiLU * mul, RoPE, residual add + RMSNorm, q/k norm + RoPE, the one-launch K/V write) against the torch
compositions they replace, on random data.
"""
from __future__ import annotations

import torch


def kernel_check(device: str, small: bool = False, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Max |diff| of the Triton kernels against torch (``small``: interpreter-sized, for a CPU smoke test)."""
    from inferflow.engine import triton_attention as ta

    if not ta.available(torch.device(device)):
        return {}
    g = torch.Generator(device=device).manual_seed(0)
    B, H, hkv, D, bs, nb = (2, 4, 2, 16, 16, 12) if small else (8, 32, 8, 128, 16, 1200)
    hid, inter = (64, 96) if small else (4096, 12288)
    kc, vc = (torch.randn(nb, bs, hkv, D, device=device, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(B, H, D, device=device, generator=g).to(dtype)
    lens = torch.tensor([1, 100] if small else [1, 15, 16, 17, 300, 1000, 1999, 2048], device=device)
    width = 8 if small else 128
    tables = torch.stack([torch.randperm(nb, device=device, generator=g)[:width] for _ in range(B)])
    out = {}
    for name, kw in {"plain": {}, "softcap": {"softcap": 30.0}, "window": {"window": 100}}.items():
        o = ta.paged_decode(q, kc, vc, tables, lens, scale=D ** -0.5, max_len=width * bs, **kw)
        r = ta.paged_decode_reference(q, kc, vc, tables, lens, scale=D ** -0.5, **kw)
        out[name] = (o.float() - r.float()).abs().max().item()
    # the fused element-wise ops against the torch compositions they replace (bf16: bit-exact expected)
    from inferflow.model import fused_ops
    from inferflow.registry import create

    x = torch.randn(64, 3 * hid, device=device, generator=g).to(dtype)[:, :hid] * 3
    w = torch.randn(hid, device=device, generator=g).to(dtype)
    h = x.float()
    ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
    out["fused_rmsnorm"] = (fused_ops.rmsnorm(x, w, 1e-6).float() - ref.float()).abs().max().item()
    gu = torch.randn(64, 2 * inter, device=device, generator=g).to(dtype) * 3
    gate, up = gu.split(inter, -1)
    out["fused_silu_mul"] = (fused_ops.silu_mul(gate, up).float() - (torch.nn.functional.silu(gate) * up).float()
                             ).abs().max().item()
    rope = create("rope", {"dim": D, "theta": 1e6})
    from inferflow.model.context import ForwardContext

    ctx = ForwardContext(positions=torch.arange(64, device=device) * 37, q_lens=[64], k_lens=[64], backend=None)
    cos, sin = rope.cos_sin(ctx, dtype)
    q = torch.randn(64, H, D, device=device, generator=g).to(dtype)
    out["fused_rope"] = (fused_ops.rope_half(q, cos, sin).float() - rope._rot(q, cos, sin).float()).abs().max().item()
    # residual add + RMSNorm, q/k norm + RoPE, the one-launch K/V write (None: the kernel declined the inputs)
    from types import SimpleNamespace

    from inferflow.engine import triton_kv_write
    from inferflow.model import fuse_add_norm, fused_qk_rope

    a, b = (torch.randn(64, hid, device=device, generator=g).to(dtype) for _ in range(2))
    sy = fuse_add_norm.add_rmsnorm(a, b, w, 1e-6)
    s = a + b
    h = s.float()
    ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    out["fused_add_rmsnorm"] = None if sy is None else max((sy[0].float() - s.float()).abs().max().item(),
                                                          (sy[1].float() - ref.float()).abs().max().item())
    qkv = torch.randn(64, (H + 2 * hkv) * D, device=device, generator=g).to(dtype) * 3
    qq, kk, vv = qkv.split([H * D, hkv * D, hkv * D], -1)
    norms = [create("rmsnorm", {"dim": D, "eps": 1e-6}) for _ in range(2)]
    for nm in norms:
        nm.weight = torch.nn.Parameter(torch.randn(D, device=device, generator=g).to(dtype), requires_grad=False)
    ctx.position = rope
    attn = SimpleNamespace(use_position=True, q_norm=norms[0], k_norm=norms[1], d=D, h=H, hkv=hkv,
                           qk_norm_per_head=True)
    got = fused_qk_rope.norm_rope(attn, qq, kk, ctx)
    want = (rope._rot(norms[0](qq.reshape(64, H, D)), cos, sin), rope._rot(norms[1](kk.reshape(64, hkv, D)), cos, sin))
    out["fused_qk_norm_rope"] = None if got is None else max((x.float() - y.float()).abs().max().item()
                                                             for x, y in zip(got, want))
    kf, vf = (torch.zeros(nb * bs, hkv, D, device=device, dtype=dtype) for _ in range(2))
    slots = torch.randperm(nb * bs, device=device, generator=g)[:64]
    k3, v3 = kk.view(64, hkv, D), vv.view(64, hkv, D)
    ok = triton_kv_write.write_kv(kf, vf, slots, k3, v3)
    out["fused_kv_write"] = None if not ok else max((kf[slots].float() - k3.float()).abs().max().item(),
                                                    (vf[slots].float() - v3.float()).abs().max().item())
    # q/k norm + RoPE + K/V store + paged attention in one kernel, against those steps composed (decode rows)
    B = len(lens)
    ctx = ForwardContext(positions=lens - 1, q_lens=[1] * B, k_lens=lens.tolist(), backend=None)
    ctx.position = rope
    cos, sin = rope.cos_sin(ctx, dtype)
    slots = tables[torch.arange(B, device=device), (lens - 1) // bs] * bs + (lens - 1) % bs
    kf, vf = kc.clone(), vc.clone()
    fused = ta.paged_decode_norm_rope(qkv[:B], H, norms[0].weight, norms[1].weight, 1e-6, 0.0, False, cos.view(B, D),
                                      sin.view(B, D), slots, kf, vf, tables, lens, scale=D ** -0.5,
                                      max_len=width * bs)
    qq, kk, vv = qkv[:B].split([H * D, hkv * D, hkv * D], -1)
    qo, ko = fused_qk_rope.norm_rope(attn, qq, kk, ctx)
    kr, vr = kc.clone(), vc.clone()
    kr.view(-1, hkv, D)[slots], vr.view(-1, hkv, D)[slots] = ko, vv.reshape(B, hkv, D)
    r = ta.paged_decode_reference(qo, kr, vr, tables, lens, scale=D ** -0.5)
    out["fused_norm_rope_attention"] = max((fused.float() - r.float()).abs().max().item(),
                                           (kf.float() - kr.float()).abs().max().item(),
                                           (vf.float() - vr.float()).abs().max().item())
    # the same over an fp8 cache (kv_cache_dtype="fp8"): the kernel rounds k/v to fp8 as it stores them and widens
    # the tiles it reads; the reference stores the composed k/v rounded the same way
    from inferflow.engine.kv_store import raw

    f8 = torch.float8_e4m3fn
    kf, vf = kc.to(f8), vc.to(f8)
    kr, vr = kf.clone(), vf.clone()
    fused = ta.paged_decode_norm_rope(qkv[:B], H, norms[0].weight, norms[1].weight, 1e-6, 0.0, False, cos.view(B, D),
                                      sin.view(B, D), slots, kf, vf, tables, lens, scale=D ** -0.5,
                                      max_len=width * bs)
    raw(kr).view(-1, hkv, D)[slots] = raw(ko.reshape(B, hkv, D).to(f8))
    raw(vr).view(-1, hkv, D)[slots] = raw(vv.reshape(B, hkv, D).to(f8))
    r = ta.paged_decode_reference(qo, kr, vr, tables, lens, scale=D ** -0.5)
    out["fused_norm_rope_attention fp8"] = max((fused.float() - r.float()).abs().max().item(),
                                               (kf.float() - kr.float()).abs().max().item(),
                                               (vf.float() - vr.float()).abs().max().item())
    kf, vf = (torch.zeros(nb * bs, hkv, D, device=device, dtype=f8) for _ in range(2))
    ok = triton_kv_write.write_kv(kf, vf, slots, k3[:B], v3[:B])
    out["fused_kv_write fp8"] = None if not ok else max(
        (raw(kf)[slots].view(f8).float() - k3[:B].to(f8).float()).abs().max().item(),
        (raw(vf)[slots].view(f8).float() - v3[:B].to(f8).float()).abs().max().item())
    # an int8 cache: the write kernel's codes and scales against quantize_int8's (count of differing elements: 0
    # wanted), and the kernel reading them with their scales against the dequantized reference
    from inferflow.engine.kv_store import quantize_int8

    kf, vf = (torch.zeros(nb * bs, hkv, D, device=device, dtype=torch.int8) for _ in range(2))
    ks, vs = (torch.zeros(nb * bs, hkv, device=device) for _ in range(2))
    ok = triton_kv_write.write_kv_int8(kf, vf, ks, vs, slots, k3[:B], v3[:B])
    (qk, sk), (qv, sv) = quantize_int8(k3[:B]), quantize_int8(v3[:B])
    out["fused_kv_write int8 (elements differing)"] = None if not ok else int(
        (kf[slots] != qk).sum() + (vf[slots] != qv).sum() + (ks[slots] != sk).sum() + (vs[slots] != sv).sum())
    (kq, kqs), (vq, vqs) = quantize_int8(kc.view(-1, hkv, D)), quantize_int8(vc.view(-1, hkv, D))
    o = ta.paged_decode(qo, kq.view(kc.shape), vq.view(vc.shape), tables, lens, scale=D ** -0.5, max_len=width * bs,
                        k_scales=kqs, v_scales=vqs)
    r = ta.paged_decode_reference(qo, kq.view(kc.shape), vq.view(vc.shape), tables, lens, scale=D ** -0.5,
                                  k_scales=kqs, v_scales=vqs)
    out["paged_decode int8"] = (o.float() - r.float()).abs().max().item()
    # the q/k norm + RoPE launch that also stores k and v (the static decode step's claim), into an int8 cache:
    # codes and scales against quantize_int8 of its own k and of v (elements differing: 0 wanted)
    from types import SimpleNamespace

    from inferflow.engine.kv_cache import KVLayer, PagedKVCache

    cache = PagedKVCache([KVLayer(7, hkv, D)], nb, bs, dtype="int8", compute_dtype=dtype, device=device)
    ctx = ForwardContext(positions=lens - 1, q_lens=[1] * B, k_lens=lens.tolist(),
                         backend=SimpleNamespace(cache=cache, slots=slots))
    ctx.position = rope
    qq, kk, vv = qkv[:B].split([H * D, hkv * D, hkv * D], -1)
    got = fused_qk_rope.norm_rope(SimpleNamespace(**vars(attn), cache_key=7), qq, kk, ctx, vv)
    if got is None or cache._claimed is None:
        out["fused_qk_norm_rope int8 store (elements differing)"] = None
    else:
        (qk, sk), (qv, sv) = quantize_int8(got[1]), quantize_int8(vv.reshape(B, hkv, D))
        st = cache._dev[7]
        ks, vs = cache.scale_stores(7)
        kf, vf = st.k.view(-1, hkv, D), st.v.view(-1, hkv, D)
        out["fused_qk_norm_rope int8 store (elements differing)"] = int(
            (kf[slots] != qk).sum() + (vf[slots] != qv).sum() + (ks[slots] != sk).sum() + (vs[slots] != sv).sum())
    return out
