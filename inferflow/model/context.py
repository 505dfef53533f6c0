"""Per-forward state shared by all components: the batch layout, positions and the attention backend.

Models run on packed token streams: hidden states are ``[N, hidden]`` for all new tokens of all
sequences, with ``q_lens`` saying how many belong to each sequence. No padding reaches the layers;
the backend knows where each sequence's keys and values live (a contiguous cache here, a paged
one in the engine).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .sdpa import sdpa

BiasFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (q_idx [Tq], k_idx [Tk]) -> [H, Tq, Tk]


@dataclass(slots=True)
class ForwardContext:
    """What one forward pass of one stack needs besides the hidden states."""

    positions: torch.Tensor                  # [N] position id of every new token
    q_lens: list[int]                        # new tokens per sequence
    k_lens: list[int]                        # keys per sequence after this step (cached + new)
    backend: "AttentionBackend"
    stack: str = "decoder"
    position: Any = None                     # the stack's position component (rope/alibi/relative)
    token_type_ids: torch.Tensor | None = None
    encoder_out: torch.Tensor | None = None  # [N_enc, hidden] packed encoder output (cross-attention)
    enc_lens: list[int] | None = None
    memo: dict[str, Any] = field(default_factory=dict)  # per-forward values shared by layers (cos/sin, masks)

    @property
    def uniform(self) -> bool:
        return len(set(self.q_lens)) == 1 and len(set(self.k_lens)) == 1


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_start: int, causal: bool, scale: float,
                   window: int | None = None, softcap: float | None = None, bias: torch.Tensor | None = None,
                   key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one or more equal-shaped sequences.

    q: [B, H, Tq, D]; k, v: [B, Hkv, Tk, D]; the queries sit at key indices ``q_start .. q_start+Tq-1``.
    bias: [H, Tq, Tk] or [B, H, Tq, Tk] added to the scaled scores; key_mask: [B, Tk] bool (True = keep), or
    float (0 = keep, -inf = drop: a decode batch's mask built once per forward, as SDPA would per call).
    """
    tq, tk = q.shape[-2], k.shape[-2]
    if (causal and window is None and key_mask is None and softcap is None and bias is None and tq == tk
            and q_start == 0):  # a whole new sequence: SDPA's own causal path, no [Tq, Tk] mask built first
        return sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    mask = None
    if causal and tq == 1 and q_start >= tk - 1:  # one query at the last key sees every key: no mask to build
        causal = False                            # (a one-token decode step; saves ~6 small ops per layer)
    if causal or window is not None:
        qi = torch.arange(q_start, q_start + tq, device=q.device)[:, None]
        ki = torch.arange(tk, device=q.device)[None, :]
        mask = ki <= qi if causal else torch.ones(tq, tk, dtype=torch.bool, device=q.device)
        if window is not None:
            mask = mask & (qi - ki < window)
    if key_mask is not None:
        km = key_mask[:, None, None, :]
        if km.dtype != torch.bool and (mask is not None or softcap is not None or bias is not None):
            km = km == 0  # a float mask that must combine with others: back to bool
        mask = km if mask is None else mask[None, None] & km
    if softcap is not None or (bias is not None and q.shape[1] != k.shape[1]):
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if bias is not None:
            scores = scores + bias.float()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    gqa = q.shape[1] != k.shape[1]
    if bias is not None:
        attn_mask = bias.to(q.dtype)
        if mask is not None:
            attn_mask = attn_mask.masked_fill(~mask, float("-inf"))
        return sdpa(q, k, v, attn_mask=attn_mask, scale=scale)
    if mask is None:
        return sdpa(q, k, v, scale=scale, enable_gqa=gqa)
    return sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


class AttentionBackend:
    """Stores new keys/values and computes attention for packed sequences.

    This dense backend keeps a contiguous per-sequence cache (or none, for one-shot forwards). The
    engine provides a paged backend with the same methods.
    """

    def __init__(self, cache: "ContiguousKVCache | None" = None, slots: list[int] | None = None):
        self.cache, self.slots = cache, slots

    def _split(self, t: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
        return list(torch.split(t, lens, dim=0)) if len(lens) > 1 else [t]

    def self_attention(self, key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, *,
                       causal: bool, scale: float, window: int | None = None, softcap: float | None = None,
                       bias_fn: BiasFn | None = None) -> torch.Tensor:
        """q: [N, H, D], k/v: [N, Hkv, D] for the new tokens; returns [N, H, D]."""
        if self.cache is None and ctx.uniform:
            b, t = len(ctx.q_lens), ctx.q_lens[0]
            qb, kb, vb = (x.view(b, t, *x.shape[1:]).transpose(1, 2) for x in (q, k, v))
            bias = bias_fn(torch.arange(t, device=q.device), torch.arange(t, device=q.device)) if bias_fn else None
            out = attention_core(qb, kb, vb, q_start=0, causal=causal, scale=scale, window=window, softcap=softcap,
                                 bias=bias)
            return out.transpose(1, 2).reshape(q.shape)
        outs = []
        for i, (qi, ki, vi) in enumerate(zip(self._split(q, ctx.q_lens), self._split(k, ctx.q_lens),
                                             self._split(v, ctx.q_lens))):
            if self.cache is not None:
                ki, vi = self.cache.append(key, self.slots[i], ki, vi)
            tq, tk = qi.shape[0], ki.shape[0]
            bias = None
            if bias_fn is not None:
                bias = bias_fn(torch.arange(tk - tq, tk, device=q.device), torch.arange(tk, device=q.device))
            o = attention_core(qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None],
                               q_start=tk - tq, causal=causal, scale=scale, window=window, softcap=softcap, bias=bias)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]

    def cross_kv(self, key: str, compute: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                 ctx: ForwardContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-sequence encoder keys/values, computed once per request when a cache is kept."""
        if self.cache is not None and self.cache.has_cross(key, self.slots[0]):
            return [self.cache.get_cross(key, s) for s in self.slots]
        k, v = compute()
        parts = list(zip(self._split(k, ctx.enc_lens), self._split(v, ctx.enc_lens)))
        if self.cache is not None:
            for s, (ki, vi) in zip(self.slots, parts):
                self.cache.set_cross(key, s, ki, vi)
        return parts

    def cross_attention(self, key: str, q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
                        ctx: ForwardContext, *, scale: float, softcap: float | None = None) -> torch.Tensor:
        outs = []
        for qi, (ki, vi) in zip(self._split(q, ctx.q_lens), kv):
            o = attention_core(qi.transpose(0, 1)[None], ki.transpose(0, 1)[None], vi.transpose(0, 1)[None],
                               q_start=0, causal=False, scale=scale, softcap=softcap)
            outs.append(o[0].transpose(0, 1))
        return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]


class ContiguousKVCache:
    """A per-sequence growable K/V store (plain generation loop); the engine uses a paged pool instead."""

    def __init__(self) -> None:
        self.kv: dict[tuple[str, int], list[torch.Tensor | int]] = {}
        self.cross: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def append(self, key: str, slot: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        entry = self.kv.get((key, slot))
        n = k.shape[0]
        if entry is None:
            cap = max(64, 1 << (n - 1).bit_length())
            kb = k.new_empty((cap, *k.shape[1:]))
            vb = v.new_empty((cap, *v.shape[1:]))
            entry = self.kv[(key, slot)] = [kb, vb, 0]
        kb, vb, used = entry
        if used + n > kb.shape[0]:
            cap = 1 << (used + n - 1).bit_length()
            nk, nv = kb.new_empty((cap, *kb.shape[1:])), vb.new_empty((cap, *vb.shape[1:]))
            nk[:used], nv[:used] = kb[:used], vb[:used]
            entry[0], entry[1] = kb, vb = nk, nv
        kb[used:used + n], vb[used:used + n] = k, v
        entry[2] = used + n
        return kb[:used + n], vb[:used + n]

    def length(self, slot: int) -> int:
        for (key, s), entry in self.kv.items():
            if s == slot:
                return entry[2]
        return 0

    def has_cross(self, key: str, slot: int) -> bool:
        return (key, slot) in self.cross

    def get_cross(self, key: str, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cross[(key, slot)]

    def set_cross(self, key: str, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.cross[(key, slot)] = (k, v)
