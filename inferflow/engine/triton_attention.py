"""Paged-attention decode as one Triton kernel pair (flash-decoding): every query row attends to its
sequence's keys read straight through its block table, no gather copy.

Grid of the first kernel: (sequence, KV head, split). A program holds the ``G = H / Hkv`` query heads that
share its KV head (GQA), walks its split's key range ``BLOCK_N`` keys at a time (each key's slot found in the
block table), and keeps an online softmax (running max ``m``, sum ``l``, unnormalised output). A second kernel
merges the splits of each (sequence, head). Splits let one long sequence use many SMs at batch 1; the number
of splits is static per call site (CUDA graphs replay fixed grids), so a split past a sequence's length runs
no iterations and leaves ``m = -1e30, l = 0``, which the merge weighs as zero.

Supports the logit soft-cap and a sliding window (keys ``k_pos > q_pos - window``, ``q_pos = len - 1``);
additive position biases (ALiBi, relative buckets) stay on the torch path (``paged_backend.py``).
``paged_decode_reference`` is the same computation in torch (CPU fallback and test oracle).
"""
from __future__ import annotations

import math

import torch

try:  # Triton is optional: CPU-only installs run the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None



def available(device: torch.device) -> bool:
    """The kernel runs on CUDA tensors, or anywhere under ``TRITON_INTERPRET=1`` (tests)."""
    import os

    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:
    @triton.jit
    def _decode_part(Q, K, V, Tables, Lens, Mo, Lo, Ao, scale, softcap, window, part,
                     sq_b, sq_h, sk_s, sk_h, sv_s, sv_h, st_b, sm_b, sm_h, sa_b, sa_h, sa_s,
                     G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CAP: tl.constexpr, HAS_WIN: tl.constexpr,
                     PREC: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        length = tl.load(Lens + b)
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        gmask = offs_g < G
        dmask = offs_d < D
        heads = kvh * G + offs_g
        q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_d[None, :], mask=gmask[:, None] & dmask[None, :],
                    other=0.0)
        m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        start = s * part
        end = tl.minimum(start + part, length)
        lo = start
        if HAS_WIN:  # keys at or below q_pos - window are out: skip whole tiles before the window
            first = length - window
            lo = tl.maximum(start, (first // BLOCK_N) * BLOCK_N)
        for n0 in range(lo, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < end
            blk = tl.load(Tables + b * st_b + offs_n // BS, mask=nmask, other=0).to(tl.int64)
            slot = blk * BS + offs_n % BS
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(K + slot[:, None] * sk_s + kvh * sk_h + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V + slot[:, None] * sv_s + kvh * sv_h + offs_d[None, :], mask=kv_mask, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale
            if HAS_CAP:  # tanh(x / c) * c, tanh written with exp (portable to the interpreter)
                qk = softcap * (1.0 - 2.0 / (tl.exp(2.0 * qk / softcap) + 1.0))
            keep = nmask
            if HAS_WIN:
                keep = keep & (offs_n > length - 1 - window)
            qk = tl.where(keep[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC).to(tl.float32)
            m_i = m_new
        tl.store(Mo + b * sm_b + heads * sm_h + s, m_i, mask=gmask)
        tl.store(Lo + b * sm_b + heads * sm_h + s, l_i, mask=gmask)
        tl.store(Ao + b * sa_b + heads[:, None] * sa_h + s * sa_s + offs_d[None, :], acc,
                 mask=gmask[:, None] & dmask[None, :])

    @triton.jit
    def _decode_merge(Mo, Lo, Ao, Out, sm_b, sm_h, sa_b, sa_h, sa_s, so_b, so_h,
                      S: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        smask = offs_s < S
        m = tl.load(Mo + b * sm_b + h * sm_h + offs_s, mask=smask, other=-1.0e30)
        l_ = tl.load(Lo + b * sm_b + h * sm_h + offs_s, mask=smask, other=0.0)
        a = tl.load(Ao + b * sa_b + h * sa_h + offs_s[:, None] * sa_s + offs_d[None, :],
                    mask=smask[:, None] & (offs_d[None, :] < D), other=0.0)
        mx = tl.max(m, 0)
        w = tl.exp(m - mx)
        o = tl.sum(a * w[:, None], 0) / tl.sum(l_ * w, 0)
        tl.store(Out + b * so_b + h * so_h + offs_d, o.to(Out.dtype.element_ty), mask=offs_d < D)


def num_splits(max_len: int, block_n: int = 64, max_splits: int = 16) -> tuple[int, int]:
    """(splits, keys per split) for sequences of up to ``max_len`` keys: at most ``max_splits``, each a
    multiple of ``block_n`` keys and no shorter than 4 tiles (short splits only add merge work)."""
    part = max(4 * block_n, math.ceil(max_len / max_splits / block_n) * block_n)
    return max(1, math.ceil(max_len / part)), part


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, *, scale: float, max_len: int, softcap: float | None = None,
                 window: int | None = None, block_n: int = 64) -> torch.Tensor:
    """q: [B, H, D]; k/v_cache: [num_blocks, block_size, Hkv, D]; tables: [B, W] block ids (int32/int64);
    lens: [B] keys per sequence (>= 1, <= max_len). Returns [B, H, D] in q's dtype.

    ``max_len`` fixes the grid (a bound on ``lens``, not its value), so a captured graph stays valid."""
    B, H, D = q.shape
    _, bs, hkv, _ = k_cache.shape
    G = H // hkv
    S, part = num_splits(max_len, block_n)
    dev = q.device
    m = torch.empty(B, H, S, dtype=torch.float32, device=dev)
    l_ = torch.empty(B, H, S, dtype=torch.float32, device=dev)
    a = torch.empty(B, H, S, D, dtype=torch.float32, device=dev)
    out = torch.empty_like(q)
    q = q.contiguous()
    kf, vf = k_cache.view(-1, hkv, D), v_cache.view(-1, hkv, D)
    BLOCK_D = max(16, triton.next_power_of_2(D))  # tl.dot needs K >= 16: small heads are padded (masked)
    _decode_part[(B, hkv, S)](
        q, kf, vf, tables, lens, m, l_, a, float(scale), float(softcap or 1.0), int(window or 0), part,
        q.stride(0), q.stride(1), kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1), tables.stride(0),
        m.stride(0), m.stride(1), a.stride(0), a.stride(1), a.stride(2),
        G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_D=BLOCK_D, BS=bs, BLOCK_N=block_n,
        HAS_CAP=softcap is not None, HAS_WIN=window is not None,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    _decode_merge[(B, H)](m, l_, a, out, m.stride(0), m.stride(1), a.stride(0), a.stride(1), a.stride(2),
                          out.stride(0), out.stride(1), S=S, BLOCK_S=max(2, triton.next_power_of_2(S)), D=D,
                          BLOCK_D=BLOCK_D, num_warps=4)
    return out


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                           lens: torch.Tensor, *, scale: float, softcap: float | None = None,
                           window: int | None = None) -> torch.Tensor:
    """The same result in torch, in float32 (the oracle of the kernel's tests)."""
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    H = q.shape[1]
    pos = torch.arange(tables.shape[1] * bs, device=q.device)
    idx = tables.long()[:, pos // bs] * bs + pos % bs
    k = k_cache.reshape(-1, hkv, q.shape[2])[idx].float().repeat_interleave(H // hkv, dim=2)  # [B, L, H, D]
    v = v_cache.reshape(-1, hkv, q.shape[2])[idx].float().repeat_interleave(H // hkv, dim=2)
    s = torch.einsum("bhd,blhd->bhl", q.float(), k) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    keep = pos[None, :] < lens[:, None]
    if window is not None:
        keep = keep & (pos[None, :] > lens[:, None] - 1 - window)
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.einsum("bhl,blhd->bhd", torch.softmax(s, -1), v).to(q.dtype)
