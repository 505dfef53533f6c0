"""Paged-attention decode as one Triton kernel (flash-decoding): every query row attends to its sequence's keys
read straight through its block table, no gather copy.

Grid: (sequence, KV head, split). A program holds the ``G = H / Hkv`` query heads that share its KV head (GQA: one
``tl.dot`` for the whole group, so each K/V tile is read once per group), walks its split's keys ``BLOCK_N`` at a
time (the next tile's block-table entries are loaded while the current tile is used) and keeps an online softmax.

Splits: the grid's split count ``S`` is static per call site (CUDA graphs replay fixed grids), chosen from the
longest context the call may see and from how many (sequence, KV head) programs already fill the GPU (none at
large batches). Each program then splits ITS sequence's live keys (the window's, when set) by its own length:
at most ``S`` splits of at least ``min_part`` keys. A sequence that needs one split writes its output directly;
one that needs several writes partial (max, sum, output) rows, and the last of its programs to finish (an atomic
ticket per (sequence, KV head)) merges them, so no second kernel runs (``_decode_merge`` stays as the fallback
while a CUDA graph captures before the ticket buffer exists). Programs past their sequence's split count exit.
The tickets are one buffer per device: calls on concurrently running streams of one device must not overlap.
Tiles: 64 keys while the (sequence, KV head) programs are fewer than the SMs, 32 once they fill the GPU.

K/V: float caches read as they are (narrower tiles widened to the queries' dtype; fp8 to fp16, in which the dot
products then run), or an int8 cache with its per-row float32 scales (codes widened exactly; each key's scale
multiplies its scores, each value's its softmax weights). Supports the logit soft-cap and a sliding window (keys
``k_pos > q_pos - window``, ``q_pos = len - 1``); heads smaller than ``tl.dot``'s minimum are padded (masked).
Additive position biases (ALiBi, relative buckets) stay on the torch path (``paged_backend.py``).
``paged_decode_reference`` is the same computation in torch (CPU fallback and test oracle).
"""
from __future__ import annotations

import math
import os

import torch

from .kv_store import raw

try:  # Triton is optional: CPU-only installs run the torch path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

# launch defaults (H200, Qwen3-8B attention shape: tools/bench_paged_decode.py)
MIN_PART, MAX_SPLITS, NUM_WARPS = 256, 16, 4
_tickets: dict[torch.device, torch.Tensor] = {}  # per device: one int32 counter per (sequence, KV head), kept at 0
_retired: list[torch.Tensor] = []


def available(device: torch.device) -> bool:
    """The kernel runs on CUDA tensors, or anywhere under ``TRITON_INTERPRET=1`` (tests)."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:
    from ..model.fused_qk_rope import norm_rope_halves

    @triton.jit
    def _seq_split(length, window, S, min_part, HAS_WIN: tl.constexpr, BLOCK_N: tl.constexpr):
        """(first live key, keys per split, split count) of one sequence of ``length`` keys."""
        lo = 0
        if HAS_WIN:  # keys at or below q_pos - window are out
            lo = tl.maximum(length - window, 0)
        live = length - lo
        want = tl.maximum(tl.minimum(S, (live + min_part - 1) // min_part), 1)
        part = ((live + want - 1) // want + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        return lo, part, (live + part - 1) // part

    @triton.jit
    def _merge_group(Mo, Lo, Ao, Out, b, heads, gmask, offs_d, dmask, nsplit, sm_b, sm_h, sa_b, sa_h, sa_s,
                     so_b, so_h, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        """Out rows of ``heads`` from their ``nsplit`` partial rows (written by other programs: read past L1)."""
        mx = tl.full([BLOCK_G], -1.0e30, tl.float32)
        for j in range(0, nsplit):
            mx = tl.maximum(mx, tl.load(Mo + b * sm_b + heads * sm_h + j, mask=gmask, other=-1.0e30,
                                        cache_modifier=".cg"))
        den = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for j in range(0, nsplit):
            w = tl.exp(tl.load(Mo + b * sm_b + heads * sm_h + j, mask=gmask, other=-1.0e30, cache_modifier=".cg")
                       - mx)
            den += w * tl.load(Lo + b * sm_b + heads * sm_h + j, mask=gmask, other=0.0, cache_modifier=".cg")
            a = tl.load(Ao + b * sa_b + heads[:, None] * sa_h + j * sa_s + offs_d[None, :],
                        mask=gmask[:, None] & dmask[None, :], other=0.0, cache_modifier=".cg")
            acc += a * w[:, None]
        den = tl.where(den > 0, den, 1.0)
        tl.store(Out + b * so_b + heads[:, None] * so_h + offs_d[None, :],
                 (acc / den[:, None]).to(Out.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])

    @triton.jit
    def _slots(row, offs, end, BS: tl.constexpr):
        """Cache slots of key positions ``offs`` (those at or past ``end``: slot 0, not read) via block-table row."""
        return tl.load(row + offs // BS, mask=offs < end, other=0).to(tl.int64) * BS + offs % BS

    @triton.jit
    def _walk(q, K, V, KS, VS, row, kvh, start, end, slot, scale, softcap, sk_s, sk_h, sv_s, sv_h, ss_s, offs_d,
              dmask, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_CAP: tl.constexpr, PREC: tl.constexpr, HAS_SCALE: tl.constexpr):
        """Online softmax (max, sum, unnormalised output) of the G query rows ``q`` over keys [start, end) read
        through the block-table row ``row`` (``slot``: the first tile's, loaded by the caller); each next tile's
        block ids are loaded while the current tile computes. (Measured on an H200: double-buffering the K/V tiles
        in registers, or loading the first tile before the sequence length arrives, was slower than this plain
        loop.) HAS_SCALE: an int8 cache, each key's and value's float32 row scale (KS, VS [slot, Hkv]) multiplies
        its scores and its softmax weights; the codes widen exactly to q's dtype."""
        m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < end
            kv_mask = nmask[:, None] & dmask[None, :]
            # tiles in the queries' dtype: an fp8 cache (or fp16 under float32 queries) widens here, as a gather would
            k = tl.load(K + slot[:, None] * sk_s + kvh * sk_h + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(V + slot[:, None] * sv_s + kvh * sv_h + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
            if HAS_SCALE:
                ks = tl.load(KS + slot * ss_s + kvh, mask=nmask, other=0.0)
                vs = tl.load(VS + slot * ss_s + kvh, mask=nmask, other=0.0)
            slot = _slots(row, offs_n + BLOCK_N, end, BS)  # the next tile's, fetched while this tile computes
            qk = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale
            if HAS_SCALE:
                qk = qk * ks[None, :]
            if HAS_CAP:  # tanh(x / c) * c, tanh written with exp (portable to the interpreter)
                qk = softcap * (1.0 - 2.0 / (tl.exp(2.0 * qk / softcap) + 1.0))
            qk = tl.where(nmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if HAS_SCALE:
                p = p * vs[None, :]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC).to(tl.float32)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _split(Q, K, V, KS, VS, Tables, Mo, Lo, Ao, Out, Tick, b, kvh, s, start, part, length, nsplit, scale,
               softcap, sq_b, sq_h, sk_s, sk_h, sv_s, sv_h, ss_s, st_b, sm_b, sm_h, sa_b, sa_h, sa_s, so_b, so_h,
               WQ, WK, C, S, sc, SLOTS, eps, offset, H, HKV,
               G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
               BLOCK_N: tl.constexpr, HAS_CAP: tl.constexpr, PREC: tl.constexpr, TICKET: tl.constexpr,
               FUSED: tl.constexpr, WEIGHT_IN_FLOAT: tl.constexpr, HAS_OFFSET: tl.constexpr,
               HAS_SCALE: tl.constexpr):
        """Split ``s`` of one (sequence, KV head): keys [start, start + part) of its ``length``. FUSED: ``Q`` is
        the raw q|k|v row; q and this step's k are normalized and rotated here (fused_qk_rope's arithmetic). The
        last split, which holds the new key, walks the cached keys before it, adds the new key from registers and
        stores k and v at the row's cache slot. (Measured on an H200: substituting the new key in every tile of
        the walk was slower than the two kernels; storing it first and reading it back after a barrier measured
        about as this does.)"""
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        gmask = offs_g < G
        dmask = offs_d < D
        heads = kvh * G + offs_g
        row = Tables + b * st_b
        end = tl.minimum(start + part, length)
        if FUSED:  # D == BLOCK_D here; rotate-half pairs i with partner (i + D / 2) % D
            last = s == nsplit - 1  # the split holding this step's key, which it takes from registers
            end = tl.where(last, end - 1, end)
            slot = _slots(row, start + tl.arange(0, BLOCK_N), end, BS)  # in flight while q is made
            qkv = Q + b * sq_b
            part_d = (offs_d + D // 2) % D
            c = tl.load(C + b * sc + offs_d).to(tl.float32)
            sn = tl.load(S + b * sc + offs_d).to(tl.float32)
            sn = tl.where(offs_d < D // 2, sn, -sn)  # first half: y c - y' s; second: y c + y' s
            dt = Q.dtype.element_ty
            hq = qkv + heads[:, None] * D
            x = tl.load(hq + offs_d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, 1) / D + eps)[:, None]
            q, _ = norm_rope_halves(x, tl.load(hq + part_d[None, :], mask=gmask[:, None], other=0.0).to(tl.float32),
                                    rstd, tl.load(WQ + offs_d).to(tl.float32)[None, :],
                                    tl.load(WQ + part_d).to(tl.float32)[None, :], c[None, :], c[None, :],
                                    sn[None, :], sn[None, :], offset, dt, WEIGHT_IN_FLOAT, HAS_OFFSET)
            if K.dtype.element_ty.is_fp8():  # an fp8 cache: fp16 dot products (below)
                q = q.to(tl.float16)
            else:
                q = q.to(K.dtype.element_ty)
        else:
            slot = _slots(row, start + tl.arange(0, BLOCK_N), end, BS)
            q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_d[None, :],
                        mask=gmask[:, None] & dmask[None, :], other=0.0)
            if K.dtype.element_ty.is_fp8():
                # an fp8 cache: the dot products in fp16, which holds every e4m3 value exactly and bf16 q exactly
                # within its normal range; one instruction widens a pair of fp8 values to fp16, not so to bf16
                q = q.to(tl.float16)
        m_i, l_i, acc = _walk(q, K, V, KS, VS, row, kvh, start, end, slot, scale, softcap, sk_s, sk_h, sv_s, sv_h,
                              ss_s, offs_d, dmask, BLOCK_G, BLOCK_D, BS, BLOCK_N, HAS_CAP, PREC, HAS_SCALE)
        if FUSED:
            if last:  # this step's k (normalized, rotated) and v: one more online-softmax step, then the store
                hk = qkv + (H + kvh) * D
                kx = tl.load(hk + offs_d).to(tl.float32)
                kn, _k2 = norm_rope_halves(kx, tl.load(hk + part_d).to(tl.float32),
                                         1.0 / tl.sqrt(tl.sum(kx * kx, 0) / D + eps),
                                         tl.load(WK + offs_d).to(tl.float32), tl.load(WK + part_d).to(tl.float32),
                                         c, c, sn, sn, offset, dt, WEIGHT_IN_FLOAT, HAS_OFFSET)
                kn = kn.to(K.dtype.element_ty)  # as the cache holds them
                vn = tl.load(qkv + (H + HKV + kvh) * D + offs_d).to(V.dtype.element_ty)
                qk = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * scale
                if HAS_CAP:
                    qk = softcap * (1.0 - 2.0 / (tl.exp(2.0 * qk / softcap) + 1.0))
                m_new = tl.maximum(m_i, qk)
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(qk - m_new)
                l_i = l_i * alpha + p
                acc = acc * alpha[:, None] + p.to(q.dtype).to(tl.float32)[:, None] * vn.to(tl.float32)[None, :]
                m_i = m_new
                at = tl.load(SLOTS + b).to(tl.int64)
                tl.store(K + at * sk_s + kvh * sk_h + offs_d, kn)
                tl.store(V + at * sv_s + kvh * sv_h + offs_d, vn)
        omask = gmask[:, None] & dmask[None, :]
        if nsplit == 1:  # the whole sequence in this program: the final rows
            den = tl.where(l_i > 0, l_i, 1.0)
            tl.store(Out + b * so_b + heads[:, None] * so_h + offs_d[None, :],
                     (acc / den[:, None]).to(Out.dtype.element_ty), mask=omask)
        else:
            tl.store(Mo + b * sm_b + heads * sm_h + s, m_i, mask=gmask)
            tl.store(Lo + b * sm_b + heads * sm_h + s, l_i, mask=gmask)
            tl.store(Ao + b * sa_b + heads[:, None] * sa_h + s * sa_s + offs_d[None, :], acc, mask=omask)
            if TICKET:  # the last program of this (sequence, KV head) merges; it leaves the ticket at 0
                tl.debug_barrier()  # every thread's partial stores precede the (release) ticket
                t = Tick + b * tl.num_programs(1) + kvh
                if tl.atomic_add(t, 1) == nsplit - 1:
                    _merge_group(Mo, Lo, Ao, Out, b, heads, gmask, offs_d, dmask, nsplit, sm_b, sm_h, sa_b,
                                 sa_h, sa_s, so_b, so_h, BLOCK_G, BLOCK_D)
                    tl.atomic_xchg(t, 0)

    @triton.jit
    def _decode_part(Q, K, V, KS, VS, Tables, Lens, Mo, Lo, Ao, Out, Tick, scale, softcap, window, min_part,
                     sq_b, sq_h, sk_s, sk_h, sv_s, sv_h, ss_s, st_b, sm_b, sm_h, sa_b, sa_h, sa_s, so_b, so_h,
                     WQ, WK, C, S_, sc, SLOTS, eps, offset, H, HKV,
                     S, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BS: tl.constexpr, BLOCK_N: tl.constexpr, HAS_CAP: tl.constexpr, HAS_WIN: tl.constexpr,
                     PREC: tl.constexpr, TICKET: tl.constexpr, FUSED: tl.constexpr, WEIGHT_IN_FLOAT: tl.constexpr,
                     HAS_OFFSET: tl.constexpr, HAS_SCALE: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        s = tl.program_id(2)
        length = tl.load(Lens + b).to(tl.int32)
        first, part, nsplit = _seq_split(length, window, S, min_part, HAS_WIN, BLOCK_N)
        if s < nsplit:  # programs past this sequence's split count exit at once
            _split(Q, K, V, KS, VS, Tables, Mo, Lo, Ao, Out, Tick, b, kvh, s, first + s * part, part, length, nsplit,
                   scale, softcap, sq_b, sq_h, sk_s, sk_h, sv_s, sv_h, ss_s, st_b, sm_b, sm_h, sa_b, sa_h, sa_s, so_b, so_h,
                   WQ, WK, C, S_, sc, SLOTS, eps, offset, H, HKV,
                   G, BLOCK_G, D, BLOCK_D, BS, BLOCK_N, HAS_CAP, PREC, TICKET, FUSED, WEIGHT_IN_FLOAT, HAS_OFFSET,
                   HAS_SCALE)

    @triton.jit
    def _decode_merge(Lens, Mo, Lo, Ao, Out, window, min_part, sm_b, sm_h, sa_b, sa_h, sa_s, so_b, so_h, S,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      HAS_WIN: tl.constexpr, BLOCK_N: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        _, _, nsplit = _seq_split(tl.load(Lens + b).to(tl.int32), window, S, min_part, HAS_WIN, BLOCK_N)
        if nsplit > 1:
            offs_g = tl.arange(0, BLOCK_G)
            offs_d = tl.arange(0, BLOCK_D)
            _merge_group(Mo, Lo, Ao, Out, b, kvh * G + offs_g, offs_g < G, offs_d, offs_d < D, nsplit, sm_b, sm_h,
                         sa_b, sa_h, sa_s, so_b, so_h, BLOCK_G, BLOCK_D)


def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: small, so tests exercise several splits


def grid_splits(max_len: int, programs: int, sms: int, *, min_part: int = MIN_PART,
                max_splits: int = MAX_SPLITS) -> int:
    """The grid's split count: enough programs for about two per SM, no more than ``max_len`` (the longest
    context the call may see) divided into ``min_part``-key parts, at most ``max_splits``."""
    return max(1, min(max_splits, math.ceil(max_len / min_part), math.ceil(2 * sms / max(programs, 1))))


def num_splits(max_len: int, block_n: int = 64, max_splits: int = MAX_SPLITS,
               min_part: int = MIN_PART) -> tuple[int, int]:
    """(splits, keys per split) a sequence of ``max_len`` keys gets with up to ``max_splits`` splits (each a
    multiple of ``block_n`` keys, at least ``min_part``): what the kernel computes per sequence."""
    want = max(1, min(max_splits, math.ceil(max_len / min_part)))
    part = math.ceil(math.ceil(max_len / want) / block_n) * block_n
    return math.ceil(max_len / part), part


def _ticket_buffer(device: torch.device, n: int) -> torch.Tensor | None:
    """Zeroed int32 tickets (the kernel leaves them at 0); made outside a graph capture only (None: merge kernel)."""
    t = _tickets.get(device)
    if t is None or t.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if t is not None:  # captured graphs may still use it: never freed (splits need n < 2 x SMs: not seen)
            _retired.append(t)
        t = _tickets[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return t


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, *, scale: float, max_len: int, softcap: float | None = None,
                 window: int | None = None, block_n: int | None = None, min_part: int = MIN_PART,
                 max_splits: int = MAX_SPLITS, num_warps: int = NUM_WARPS, num_stages: int | None = None,
                 ticket: bool = True, k_scales: torch.Tensor | None = None,
                 v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, H, D]; k/v_cache: [num_blocks, block_size, Hkv, D]; tables: [B, W] block ids (int32/int64);
    lens: [B] keys per sequence (>= 1, <= max_len). Returns [B, H, D] in q's dtype. An int8 cache comes with its
    float32 row scales ``k_scales``, ``v_scales`` [num_blocks * block_size, Hkv] (kv_cache.scale_stores).

    ``max_len`` fixes the grid (a bound on ``lens``, not its value), so a captured graph stays valid.
    ``ticket=False`` merges multi-split sequences in a second kernel instead of in the last program. ``block_n``
    None: 64-key tiles while the (sequence, KV head) programs are fewer than the SMs (latency-bound: fewer, larger
    tiles), 32 once they fill the GPU (bandwidth-bound: smaller tiles let more programs share an SM; 128 over an
    fp8 cache). Narrower K/V tiles widen as they are read: fp8 ones to fp16, in which the dot products then run
    (q too), others to q's dtype (an fp16 cache under float32 queries)."""
    q = q.contiguous()
    return _launch(q, q.shape[1], None, k_cache, v_cache, tables, lens, scale=scale, max_len=max_len,
                   softcap=softcap, window=window, block_n=block_n, min_part=min_part, max_splits=max_splits,
                   num_warps=num_warps, num_stages=num_stages, ticket=ticket, scales=(k_scales, v_scales))


def paged_decode_norm_rope(qkv: torch.Tensor, heads: int, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
                           offset: float, weight_in_float: bool, cos: torch.Tensor, sin: torch.Tensor,
                           slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                           lens: torch.Tensor, *, scale: float, max_len: int, softcap: float | None = None,
                           window: int | None = None, min_part: int = MIN_PART) -> torch.Tensor:
    """:func:`paged_decode` of the decode rows' raw q|k|v projections [B, (H + 2 Hkv) D] in one launch with what
    runs before it: per-head RMSNorm of q and k (weights ``q_norm``, ``k_norm`` [D]), rotate-half RoPE (``cos``,
    ``sin`` rows [B, D]) and the store of this step's k and v at ``slots`` [B] (``fused_qk_rope``'s kernel, with
    its roundings). Each sequence's new key is the last of its ``lens``. D a power of two, at least 16. Float caches
    only: over int8 the fused store measured slower than the two kernels (docs/benchmarks.md)."""
    B, width = qkv.shape
    d = k_cache.shape[-1]
    fused = (q_norm, k_norm, float(eps), float(offset), bool(weight_in_float), cos, sin, slots, width)
    return _launch(qkv, heads, fused, k_cache, v_cache, tables, lens, scale=scale, max_len=max_len,
                   softcap=softcap, window=window, min_part=min_part, q_strides=(qkv.stride(0), d))


def _launch(q: torch.Tensor, H: int, fused: tuple | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
            tables: torch.Tensor, lens: torch.Tensor, *, scale: float, max_len: int, softcap: float | None,
            window: int | None, block_n: int | None = None, min_part: int = MIN_PART, max_splits: int = MAX_SPLITS,
            num_warps: int = NUM_WARPS, num_stages: int | None = None, ticket: bool = True,
            q_strides: tuple[int, int] | None = None,
            scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)) -> torch.Tensor:
    B = q.shape[0]
    ks, vs = scales
    if (ks is None) != (k_cache.dtype != torch.int8) or (vs is None) != (ks is None):
        raise ValueError(f"paged_decode: an int8 cache needs k_scales and v_scales, other dtypes none "
                         f"(cache {k_cache.dtype}, scales given: {ks is not None}, {vs is not None})")
    if ks is not None and (ks.shape != vs.shape or ks.stride(1) != 1 or vs.stride() != ks.stride()):
        raise ValueError(f"paged_decode: k_scales / v_scales must be [slots, Hkv] rows of one layout, got "
                         f"{tuple(ks.shape)} / {tuple(vs.shape)}")
    _, bs, hkv, D = k_cache.shape
    G = H // hkv
    dev = q.device
    live = min(max_len, window) if window is not None else max_len
    sms = _sms(dev)
    if block_n is None:  # an fp8 cache's tiles are half the bytes: 128 keys a tile (H200: 157 against 173 us for
        # 256 rows x 640 keys; 16-bit caches: 212 against 176 us)
        block_n = (128 if k_cache.element_size() == 1 else 32) if B * hkv >= sms else 64
    S = grid_splits(live, B * hkv, sms, min_part=min_part, max_splits=max_splits)
    out = torch.empty(B, H, D, dtype=q.dtype, device=dev)
    if S > 1:
        m = torch.empty(B, H, S, dtype=torch.float32, device=dev)
        l_ = torch.empty(B, H, S, dtype=torch.float32, device=dev)
        a = torch.empty(B, H, S, D, dtype=torch.float32, device=dev)
    else:  # every sequence runs in one split: no partial rows
        m = l_ = a = out
    tick = _ticket_buffer(dev, B * hkv) if S > 1 and ticket else None
    kf, vf = k_cache.view(-1, hkv, D), v_cache.view(-1, hkv, D)
    BLOCK_D = max(16, triton.next_power_of_2(D))  # tl.dot needs K >= 16: small heads are padded (masked)
    BLOCK_G = max(16, triton.next_power_of_2(G))
    win = int(window or 0)
    sa = (a.stride(0), a.stride(1), a.stride(2)) if S > 1 else (0, 0, 0)
    sm = (m.stride(0), m.stride(1)) if S > 1 else (0, 0)
    extra = {} if num_stages is None else {"num_stages": num_stages}
    if fused is None:  # unused pointers and values of the fused form
        wq, wk, eps, offset, in_float, cos, sin, slots = q, q, 0.0, 0.0, False, q, q, lens
        sc = 0
    else:
        wq, wk, eps, offset, in_float, cos, sin, slots, _ = fused
        sc = cos.stride(0)
    # the dtype the dot products run in: q's, or the fused path's (the cache's, unless 8-bit: then q's)
    adt = q.dtype if fused is None or k_cache.element_size() == 1 else k_cache.dtype
    _decode_part[(B, hkv, S)](
        q, kf, vf, out if ks is None else ks, out if vs is None else vs, tables, lens, m, l_, a, out, tick if tick is not None else out, float(scale),
        float(softcap or 1.0), win, min_part,
        *(q_strides or (q.stride(0), q.stride(1))), kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1),
        0 if ks is None else ks.stride(0), tables.stride(0), *sm, *sa, out.stride(0), out.stride(1),
        wq, wk, cos, sin, sc, slots, eps, offset, H, hkv, S,
        G=G, BLOCK_G=BLOCK_G, D=D, BLOCK_D=BLOCK_D, BS=bs, BLOCK_N=block_n,
        HAS_CAP=softcap is not None, HAS_WIN=window is not None,
        PREC="ieee" if adt == torch.float32 else "tf32", TICKET=tick is not None,
        FUSED=fused is not None, WEIGHT_IN_FLOAT=in_float, HAS_OFFSET=bool(offset), HAS_SCALE=ks is not None,
        num_warps=num_warps, **extra)
    if S > 1 and tick is None:
        _decode_merge[(B, hkv)](lens, m, l_, a, out, win, min_part, *sm, *sa, out.stride(0), out.stride(1), S,
                                G=G, BLOCK_G=BLOCK_G, D=D, BLOCK_D=BLOCK_D, HAS_WIN=window is not None,
                                BLOCK_N=block_n, num_warps=4)
    return out


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                           lens: torch.Tensor, *, scale: float, softcap: float | None = None,
                           window: int | None = None, k_scales: torch.Tensor | None = None,
                           v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The same result in torch, in float32 (the oracle of the kernel's tests)."""
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    H = q.shape[1]
    pos = torch.arange(tables.shape[1] * bs, device=q.device)
    idx = tables.long()[:, pos // bs] * bs + pos % bs

    def rows(c, sc):  # [B, L, H, D] in float32
        x = raw(c).reshape(-1, hkv, q.shape[2])[idx].view(c.dtype).float()
        if sc is not None:
            x = x * sc.reshape(-1, hkv)[idx][..., None]
        return x.repeat_interleave(H // hkv, dim=2)

    k, v = rows(k_cache, k_scales), rows(v_cache, v_scales)
    s = torch.einsum("bhd,blhd->bhl", q.float(), k) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    keep = pos[None, :] < lens[:, None]
    if window is not None:
        keep = keep & (pos[None, :] > lens[:, None] - 1 - window)
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    return torch.einsum("bhl,blhd->bhd", torch.softmax(s, -1), v).to(q.dtype)
