"""The truncation samplers a random (or mirostat) row draws from, all over ONE descending sort of its logits:
temperature, then top-k -> top-p -> min-p -> typical -> tail-free, or mirostat v2's surprise cap. Each filter takes
the sorted logits ``s`` [n, V] and a per-row setting column [n, 1] and sets removed tokens to -inf; ``truncate``
runs the stages a batch needs (a row that does not use a stage passes through unchanged). See sampler.py.
"""
from __future__ import annotations

import math

import torch

from .logits_processors import NEG_INF
from .sampling_state import GREEDY_BELOW, SeqSampling, column, small_tensor


def top_k_filter(s: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Top-k (Fan et al. 2018): keep the k most probable tokens. ``s`` sorted descending; ``k`` [n, 1] (V: off)."""
    return s.masked_fill(torch.arange(s.shape[1], device=s.device) >= k, NEG_INF)


def top_p_filter(s: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus (Holtzman et al. 2020): keep the smallest prefix of the sorted tokens whose mass is >= p, i.e.
    drop a token once the mass before it already reaches p (the top token always stays). ``top_p`` [n, 1]."""
    probs = torch.softmax(s, -1)
    before = torch.cat([torch.zeros_like(probs[:, :1]), probs.cumsum(-1)[:, :-1]], 1)
    return s.masked_fill((before >= top_p) & (top_p < 1.0), NEG_INF)


def min_p_filter(s: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Min-p (Nguyen et al. 2024): keep tokens with ``p >= min_p * p_max`` (``s`` sorted: p_max is column 0)."""
    probs = torch.softmax(s, -1)
    return s.masked_fill(probs < min_p * probs[:, :1], NEG_INF)


def typical_filter(s: torch.Tensor, typical_p: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meier et al. 2022): rank tokens by ``|-log p - H|`` (H the entropy) and keep the
    smallest set, in that order, whose mass is >= typical_p.

    No second sort: along the descending-probability order ``R = -log p - H`` is non-decreasing, so the score
    ``|R|`` falls then rises and the typical order merges two monotone runs (left of the crossing, walked
    backwards, and right of it). Each token's rank in that merge comes from one batched searchsorted; ties
    between the runs go to the more probable (left) token."""
    V = s.shape[1]
    logp = torch.log_softmax(s, -1)
    p = logp.exp()
    H = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1, keepdim=True)
    R = (-logp - H).contiguous()                       # +inf for removed tokens (they rank last)
    c = (R < 0).sum(-1, keepdim=True)                  # the crossing: tokens more probable than "typical"
    pos = torch.arange(V, device=s.device)
    below = torch.searchsorted(R, (-R).contiguous(), side="left")  # #{k: R_k < -R_j}
    rank = torch.where(pos < c, (c - 1 - pos) + below - c, pos - below)
    mass = torch.zeros_like(p).scatter_(1, rank, p)
    before = torch.cat([torch.zeros_like(p[:, :1]), mass.cumsum(-1)[:, :-1]], 1).gather(1, rank)
    return s.masked_fill((before >= typical_p) & (typical_p < 1.0), NEG_INF)


def tail_free_filter(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Tail-free sampling (T. Bricken, 2019, "Tail-Free Sampling"): on the sorted candidate probabilities, the
    absolute second differences ``|p[i] - 2 p[i+1] + p[i+2]|`` (the curvature at token i+1), normalised to sum 1,
    accumulate along the tail; token j (1 <= j <= n-2) stays while that sum up to its own curvature is <= z,
    the top token always stays and the last candidate goes (it has no curvature). Flat distributions (no
    curvature) use uniform weights, as llama.cpp does. Computed over the n tokens earlier stages kept."""
    n_rows, V = s.shape
    if V < 3:
        return s
    p = torch.softmax(s, -1)
    n = torch.isfinite(s).sum(-1, keepdim=True)
    valid = torch.arange(V - 2, device=s.device) < n - 2
    d2 = (p[:, :-2] - 2 * p[:, 1:-1] + p[:, 2:]).abs() * valid
    total = d2.sum(-1, keepdim=True)
    w = torch.where(total > 1e-6, d2 / total.clamp_min(1e-30), valid / (n - 2).clamp_min(1))
    keep = torch.zeros_like(s, dtype=torch.bool)
    keep[:, 0] = True
    keep[:, 1:-1] = (w.cumsum(-1) <= z) & valid
    keep |= (n <= 2) & torch.isfinite(s)
    return s.masked_fill(~keep & (z < 1.0), NEG_INF)


def mirostat_filter(s: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Mirostat v2 truncation (Basu et al. 2021; llama.cpp / Inferflow's v2): drop tokens whose surprise
    ``-log2 p`` exceeds ``mu`` (the top token always stays). The mu update follows the draw (see Sampler)."""
    surprise = -torch.log_softmax(s, -1) / math.log(2.0)
    drop = surprise > mu
    drop[:, 0] = False
    return s.masked_fill(drop, NEG_INF)


def truncate(x: torch.Tensor, seqs: list[SeqSampling]) -> torch.Tensor:
    """The logits each (random or mirostat) row samples from: temperature, then top-k -> top-p -> min-p ->
    typical -> tail-free, or mirostat's cut, all over one sort; removed tokens at -inf."""
    params = [sq.params for sq in seqs]
    n, V = x.shape
    dev = x.device
    miro = [p.mirostat == 2 for p in params]
    temp = [p.temperature if p.temperature >= GREEDY_BELOW else 1.0 for p in params]
    x = x / column(temp, dev)
    # mirostat replaces the truncation samplers, so its rows' settings read as "off"
    k = [V if m or p.top_k <= 0 else min(p.top_k, V) for p, m in zip(params, miro)]
    top_p = [1.0 if m else p.top_p for p, m in zip(params, miro)]
    min_p = [0.0 if m else p.min_p for p, m in zip(params, miro)]
    typ = [1.0 if m else p.typical_p for p, m in zip(params, miro)]
    tfs = [1.0 if m else p.tfs_z for p, m in zip(params, miro)]
    for sq, m in zip(seqs, miro):
        if m and sq.mirostat_mu is None:
            sq.mirostat_mu = 2.0 * sq.params.mirostat_tau
    need = [i for i in range(n) if miro[i] or k[i] < V or top_p[i] < 1 or min_p[i] > 0 or typ[i] < 1
            or tfs[i] < 1]
    if not need:
        return x
    every = len(need) == n
    s, order = torch.sort(x if every else x.index_select(0, small_tensor(need, dev)), dim=-1, descending=True)
    sel = lambda vals: [vals[i] for i in need]  # noqa: E731
    if any(v < V for v in sel(k)):
        s = top_k_filter(s, column(sel(k), dev, torch.long))
    if any(v < 1 for v in sel(top_p)):
        s = top_p_filter(s, column(sel(top_p), dev))
    if any(v > 0 for v in sel(min_p)):
        s = min_p_filter(s, column(sel(min_p), dev))
    if any(v < 1 for v in sel(typ)):
        s = typical_filter(s, column(sel(typ), dev))
    if any(v < 1 for v in sel(tfs)):
        s = tail_free_filter(s, column(sel(tfs), dev))
    if any(sel(miro)):
        mu = [seqs[i].mirostat_mu if miro[i] else math.inf for i in need]
        s = mirostat_filter(s, column(mu, dev))
    back = torch.full_like(s, NEG_INF).scatter_(1, order, s)
    return back if every else x.index_copy(0, small_tensor(need, dev), back)
