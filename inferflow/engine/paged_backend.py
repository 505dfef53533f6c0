"""Attention through the paged KV cache: the engine's ``AttentionBackend``.

Every new token's K/V is written at its slot (``slot_mapping``); each sequence then attends to its
first ``k_len`` keys, read through its block table, with the queries at key indices
``k_len - q_len .. k_len - 1`` (so chunked prefill on top of cached blocks just works).

Decode rows (q_len == 1), the bulk of a memory-bound serving step, run as ONE call for all of them
(``paged_rows.py``): the Triton paged kernel reading K/V in place on CUDA, else one padded gather
where the causal limit, the sliding window and ALiBi / relative biases become per-row key masks
and a bias evaluated with one query index per row. Whole new sequences
attend to their fresh K/V without a gather: adjacent ones of one length as one batched call, and a
step of new prompts of many lengths as one varlen flash call on CUDA (``varlen.py``). A step with
prefill chunks on top of cached blocks (prefix-cache hits, long prompts split into chunks) gathers
those chunks' keys and runs them as one varlen call with per-row key offsets; with windows,
soft-capping, biases or on a CPU each chunk runs with a mask of its own. Index tensors are
built once per forward and shared by all layers; no device->host syncs happen here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable

import torch

from ..errors import InferflowError
from ..model.context import AttentionBackend, BiasFn, ForwardContext, attention_core
from . import varlen
from .paged_cross import PagedCrossAttention
from .paged_rows import DecodeRows
from .kv_cache import PagedKVCache

VARLEN_MIN_RUNS = 3  # from this many runs of new prompts (as many calls) on, one varlen call takes them all
# steps with chunks on cached blocks as one varlen call (=0: a masked call per chunk, for A/B runs)
VARLEN_CHUNKS = os.environ.get("INFERFLOW_VARLEN_CHUNKS", "1") != "0"
# keys gathered for one varlen call at most (more: several calls): bounds the transient K/V copy of a step of many
# prefix-cache hits on long contexts (K and V of 128k keys of 8 KV heads x 128 in bf16: 512 MiB)
CHUNK_KEYS_PER_CALL = 1 << 17


@dataclass(slots=True)
class _Plan:
    """The batch layout of one forward, shared by its layers."""

    ctx: ForwardContext
    starts: list[int]                               # first token of each row in the packed stream
    dec: list[int]                                  # rows batched as decodes
    seqs: list[tuple[int, int, int, int, int]]      # (row, start, end, q_len, k_len) of the other rows
    runs: list[tuple[int, int, int, int]]           # (start, end, count, length) of adjacent whole-new equal rows
    new_only: bool                                  # every row is a whole new sequence
    ends: list[int]                                 # each row's end in the packed stream
    pure: bool                                      # every row is in ``dec`` (and in order)
    ragged: bool                                    # decode rows differ in k_len (a key mask is needed)
    chunks: list = field(default_factory=list)      # the rows of ``seqs`` on cached keys (q_len < k_len)
    lmax: int = 0
    memo: dict = field(default_factory=dict)        # (name, device) -> tensor


class PagedAttentionBackend(DecodeRows, PagedCrossAttention, AttentionBackend):
    """Self-attention over paged K/V; cross-attention K/V kept per request in ``cross`` dicts.

    block_tables: per sequence (batch order) its device block ids, as lists or as one padded
    [B, max_blocks] LongTensor (saves converting every block id each step). slot_mapping: [N] the slot
    of each new token (``PagedKVCache.slot_mapping`` builds it). cross: per sequence a dict (attention
    cache_key -> (k, v)) owned by the request; keys missing there are computed from ``ctx.encoder_out``,
    which packs the encoder outputs of exactly the sequences missing them, in batch order, and stored
    into the dicts.
    Layers the cache does not hold (an encoder run through this backend) get plain uncached attention.
    """

    def __init__(self, cache: PagedKVCache, block_tables: list[list[int]] | torch.Tensor, slot_mapping: torch.Tensor,
                 cross: list[dict] | None = None):
        super().__init__()
        self.cache, self.block_tables, self.slot_mapping, self.cross = cache, block_tables, slot_mapping, cross
        self._plan: _Plan | None = None
        self._dense = AttentionBackend()

    # ---- per-forward layout ---------------------------------------------------------------------
    def _plan_for(self, ctx: ForwardContext) -> _Plan:
        p = self._plan
        if p is not None and p.ctx is ctx:
            return p
        if len(self.block_tables) != len(ctx.q_lens):
            raise InferflowError(f"paged attention: {len(self.block_tables)} block tables for {len(ctx.q_lens)} sequences")
        dec = [i for i, n in enumerate(ctx.q_lens) if n == 1]
        if len(dec) < 2 and len(ctx.q_lens) > 1:  # a lone decode among prefills: its own call (no padding)
            dec = []
        seqs, starts, start, in_dec = [], [], 0, set(dec)
        for i, (ql, kl) in enumerate(zip(ctx.q_lens, ctx.k_lens)):
            if i not in in_dec:
                seqs.append((i, start, start + ql, ql, kl))
            starts.append(start)
            start += ql
        dk = [ctx.k_lens[i] for i in dec]
        new_only = not dec and all(ql == kl for ql, kl in zip(ctx.q_lens, ctx.k_lens))
        p = self._plan = _Plan(ctx, starts, dec, seqs, _runs(seqs), new_only, [*starts[1:], start], pure=not seqs,
                               ragged=bool(dk) and min(dk) != max(dk), chunks=[r for r in seqs if r[3] < r[4]],
                               lmax=max(dk, default=0))
        return p

    def _on(self, p: _Plan, name, device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A per-forward index/mask tensor, built once and copied once to each device that needs it."""
        t = p.memo.get((name, device))
        if t is None:
            base = p.memo.get((name, None))
            if base is None:
                base = p.memo[(name, None)] = make()
            t = p.memo[(name, device)] = base.to(device)
        return t

    # ---- self-attention -------------------------------------------------------------------------
    def self_attention(self, key: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, *,
                       causal: bool, scale: float, window: int | None = None, softcap: float | None = None,
                       bias_fn: BiasFn | None = None) -> torch.Tensor:
        """q: [N, H, D], k/v: [N, Hkv, D] for the new tokens; returns [N, H, D]."""
        kv = self.cache
        if not kv.has_layer(key):
            return self._dense.self_attention(key, q, k, v, ctx, causal=causal, scale=scale, window=window,
                                              softcap=softcap, bias_fn=bias_fn)
        p = self._plan_for(ctx)
        if p.pure and q.device.type == "cpu" and softcap is None and bias_fn is None:
            out = self._native_decode(key, p, q, k, v, scale, window)  # K/V write + attention as one native call
            if out is not None:
                return out
        sdev, cdev = kv.storage_device(key), kv.compute_device(key)
        kv.write(key, self._on(p, "slots", sdev, lambda: self.slot_mapping), k, v)
        qc = q if q.device == cdev else q.to(cdev)
        args = (causal, scale, window, softcap, bias_fn)
        if (not p.pure and (p.dec or p.chunks) and causal and softcap is None and bias_fn is None
                and qc.device.type == "cpu"):
            got = self._native_rows(key, p, qc, scale, window)  # decode rows and chunks: one native call
            if got is not None:
                out, tok = got
                if tok is not None:  # whole new prompts beside them: their own calls
                    out = torch.empty_like(qc).index_copy_(0, tok, out)
                    self._seqs_each(key, p, qc, k, v, out, sdev, cdev, *args, chunks=False)
                return out if out.device == q.device else out.to(q.device)
        if p.pure:
            out = self._decode(key, p, qc, sdev, cdev, *args)
        elif len(p.runs) == 1 and p.runs[0][1] - p.runs[0][0] == qc.shape[0]:  # one run is the whole batch
            out = self._run(qc, k, v, cdev, p.runs[0], *args).reshape(qc.shape)  # a view where SDPA's out is BTHD
        elif len(p.runs) >= VARLEN_MIN_RUNS and p.new_only and self._varlen_ok(qc, *args):  # many lengths: one call
            cu = self._on(p, "cu_seq", cdev, lambda: torch.tensor([0, *p.ends], dtype=torch.int32))
            out = varlen.varlen_causal(qc, k.to(cdev), v.to(cdev), cu, max(p.ctx.q_lens), scale)
        elif not p.dec and not p.runs and VARLEN_CHUNKS and self._varlen_ok(qc, *args):  # every row on cached keys
            out = self._chunks_varlen(key, p, qc, sdev, cdev, scale)  # (prefix-cache hits, a long prompt's chunks)
        else:
            out = torch.empty_like(qc)
            if p.dec:
                tok = self._on(p, "dec_tok", cdev, lambda: torch.tensor([p.starts[i] for i in p.dec]).to(kv.device))
                out.index_copy_(0, tok, self._decode(key, p, qc.index_select(0, tok), sdev, cdev, *args))
            at_once = bool(p.chunks) and VARLEN_CHUNKS and self._varlen_ok(qc, *args)
            self._seqs_each(key, p, qc, k, v, out, sdev, cdev, *args, chunks=not at_once)
            if at_once:  # the chunks as one call, as above
                tok = self._on(p, "chunk_tok", cdev, lambda: torch.cat([torch.arange(s, e) for _, s, e, _, _ in p.chunks]))
                out.index_copy_(0, tok, self._chunks_varlen(key, p, qc.index_select(0, tok), sdev, cdev, scale))
        return out if out.device == q.device else out.to(q.device)

    def _seqs_each(self, key: int, p: _Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   sdev: torch.device, cdev: torch.device, causal: bool, scale: float, window: int | None,
                   softcap: float | None, bias_fn: BiasFn | None, chunks: bool = True) -> None:
        """The rows of ``p.seqs`` into ``out``: each run of whole new prompts as one call on their fresh K/V; with
        ``chunks``, every other row (a chunk on cached blocks) with a gather and a masked call of its own (windows,
        soft-capping, biases, CPUs)."""
        kv, args = self.cache, (causal, scale, window, softcap, bias_fn)
        for run in p.runs:
            s, e, b, t = run
            out[s:e].unflatten(0, (b, t)).copy_(self._run(q, k, v, cdev, run, *args))
        for row, s, e, ql, kl in p.chunks if chunks else ():
            idx = self._on(p, ("seq", row), sdev, lambda: kv.seq_index(self.block_tables[row], kl))  # noqa: B023
            ki, vi = kv.gather_idx(key, idx)
            bias = None
            if bias_fn is not None:
                bias = bias_fn(torch.arange(kl - ql, kl, device=cdev), torch.arange(kl, device=cdev))
            o = attention_core(q[s:e].transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None],
                               q_start=kl - ql, causal=causal, scale=scale, window=window, softcap=softcap, bias=bias)
            out[s:e] = o[0].transpose(0, 1)

    @staticmethod
    def _varlen_ok(q: torch.Tensor, causal: bool, scale: float, window: int | None, softcap: float | None,
                   bias_fn: BiasFn | None) -> bool:
        return causal and window is None and softcap is None and bias_fn is None and varlen.usable(q, q.shape[-1])

    def _chunks_varlen(self, key: int, p: _Plan, q: torch.Tensor, sdev: torch.device, cdev: torch.device,
                       scale: float) -> torch.Tensor:
        """Attention of the rows of ``p.chunks`` (prefill chunks on cached blocks, a lone decode among prefills;
        ``q``: their tokens, packed) as ONE varlen flash call over their keys gathered from the cache (the new ones
        already written), instead of a gather, a [Tq, Tk] mask and a masked SDPA call per row. Flash aligns the
        causal limit bottom-right: a chunk's. (Whole new prompts stay on their fresh K/V: batched calls by
        length, cuDNN's for recurring big shapes, beat one varlen call over gathered keys.)"""
        groups = p.memo.get("chunk_groups")
        if groups is None:
            groups = p.memo["chunk_groups"] = _key_groups([r[4] for r in p.chunks], CHUNK_KEYS_PER_CALL)
        out = None if len(groups) == 1 else torch.empty_like(q)
        q0 = 0
        for g, (a, b) in enumerate(groups):
            rows = p.chunks[a:b]
            ql, kl = [r[3] for r in rows], [r[4] for r in rows]

            def keys() -> torch.Tensor:  # slots of every key of every row, packed row after row
                tables = [self.block_tables[r] for r, *_ in rows]  # noqa: B023 - called at once
                if isinstance(self.block_tables, torch.Tensor):
                    tables = [t.tolist() for t in tables]
                return self.cache.slot_mapping(tables, [0] * len(kl), kl, device=torch.device("cpu"))  # noqa: B023

            kk, vv = self.cache.gather_idx(key, self._on(p, ("chunk_keys", g), sdev, keys))
            cu_q = self._on(p, ("chunk_cu_q", g), cdev, lambda: torch.tensor([0, *accumulate(ql)], dtype=torch.int32))
            cu_k = self._on(p, ("chunk_cu_k", g), cdev, lambda: torch.tensor([0, *accumulate(kl)], dtype=torch.int32))
            q1 = q0 + sum(ql)
            o = varlen.varlen_causal(q[q0:q1], kk, vv, cu_q, max(ql), scale, cu_seq_k=cu_k, max_k=max(kl))
            if out is None:
                return o
            out[q0:q1] = o
            q0 = q1
        return out

    @staticmethod
    def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cdev: torch.device, run: tuple[int, int, int, int],
             causal: bool, scale: float, window: int | None, softcap: float | None,
             bias_fn: BiasFn | None) -> torch.Tensor:
        """Adjacent whole-new sequences of one length as ONE [B, H, T, D] attention call over their fresh K/V (views
        of the packed stream): one kernel launch with B times the blocks in flight, not B launches. -> a [B, T, H, D]
        view of the output (contiguous when SDPA's kernel writes BTHD, as flash and cuDNN do)"""
        s, e, b, t = run
        qb = q[s:e].unflatten(0, (b, t)).transpose(1, 2)
        kb, vb = (x[s:e].to(cdev).unflatten(0, (b, t)).transpose(1, 2) for x in (k, v))
        bias = None
        if bias_fn is not None:  # the same [H, T, T] for every sequence of the run
            pos = torch.arange(t, device=cdev)
            bias = bias_fn(pos, pos)
        o = attention_core(qb, kb, vb, q_start=0, causal=causal, scale=scale, window=window, softcap=softcap,
                           bias=bias)
        return o.transpose(1, 2)


def _key_groups(k_lens: list[int], cap: int) -> list[tuple[int, int]]:
    """Consecutive rows [a, b) whose keys add up to at most ``cap`` (a row with more keys alone)."""
    groups, a, total = [], 0, 0
    for i, n in enumerate(k_lens):
        if i > a and total + n > cap:
            groups.append((a, i))
            a, total = i, 0
        total += n
    return groups + [(a, len(k_lens))]


def _runs(seqs: list[tuple[int, int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """(start, end, count, length) of maximal runs of whole-new rows (q_len == k_len) of one length that sit next
    to each other in the packed stream."""
    runs: list[list[int]] = []
    for _, s, e, ql, kl in seqs:
        if ql != kl:
            continue
        r = runs[-1] if runs else None
        if r is not None and r[1] == s and r[3] == ql:
            r[1], r[2] = e, r[2] + 1
        else:
            runs.append([s, e, 1, ql])
    return [tuple(r) for r in runs]  # type: ignore[misc]
