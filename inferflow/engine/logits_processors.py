"""Logit processors: per-request edits of the model's logits before any sampler sees them.

Each function takes the whole ``[B, V]`` float32 logits tensor and the batch's per-row settings and edits
only the rows that use it (vectorised through index tensors / masks; rows that do not use a processor pass
through bit-for-bit unchanged). Order (see SamplingParams): allowed_token_ids -> logit_bias -> repetition
penalty -> presence/frequency penalties -> min_tokens. The FSD n-gram penalty lives here too (`NGramPenalty`)
but is applied by the FSD sampler, which scores only its top-k candidates.

Who handles EOS, for the record:
- min_tokens: masked here (EOS ids and stop_token_ids at -inf until ``min_tokens`` tokens were produced);
  EOS is not masked for ``ignore_eos`` requests, for which EOS is an ordinary token (vLLM's rule).
- ignore_eos: nothing here; the sampler may sample EOS like any token, and the ENGINE does not finish the
  sequence on it (the token stays in the output).
- eos_bypass_max (Inferflow): done by the sampler after choosing (it needs the chosen token and the
  candidates); it counts bypasses in ``SeqSampling.eos_bypassed``.
- stop_token_ids and stop strings: the engine finishes on them (see stop.py for strings).
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch

from ..errors import InferflowError
from .sampling_params import SamplingParams

NEG_INF = float("-inf")


def validate(params: SamplingParams, vocab_size: int) -> None:
    """Refuse token ids outside the vocabulary at admission (the sampler itself silently drops them, so a bad
    request can never fail a whole batch step)."""
    for key, ids in (("logit_bias", list(params.logit_bias)), ("allowed_token_ids", params.allowed_token_ids or []),
                     ("stop_token_ids", params.stop_token_ids)):
        bad = [i for i in ids if not 0 <= int(i) < vocab_size]
        if bad:
            raise InferflowError(f"sampling: {key} names token id(s) {bad[:5]} outside the vocabulary "
                                 f"(0..{vocab_size - 1})")
    if params.allowed_token_ids is not None and not params.allowed_token_ids:
        raise InferflowError("sampling: allowed_token_ids is empty; expected at least one token id or null")


def _sparse(rows: list[int], lists: list[Sequence[int]], V: int, device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs for ragged per-row id lists, ids outside [0, V) dropped."""
    r = [row for row, ids in zip(rows, lists) for i in ids if 0 <= i < V]
    c = [i for ids in lists for i in ids if 0 <= i < V]
    return (torch.tensor(r, dtype=torch.long, device=device), torch.tensor(c, dtype=torch.long, device=device))


def token_counts(rows: list[int], lists: list[Sequence[int]], B: int, V: int, device: torch.device) -> torch.Tensor:
    """``[B, V]`` occurrence counts of each row's ids (rows not in ``rows`` stay zero)."""
    counts = torch.zeros(B, V, device=device)
    r, c = _sparse(rows, lists, V, device)
    if r.numel():
        counts.index_put_((r, c), torch.ones_like(r, dtype=counts.dtype), accumulate=True)
    return counts


def apply_allowed_tokens(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``allowed_token_ids`` (vLLM): every other token goes to -inf."""
    rows = [b for b, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return logits
    B, V = logits.shape
    keep = torch.zeros(B, V, dtype=torch.bool, device=logits.device)
    keep[_sparse(rows, [params[b].allowed_token_ids for b in rows], V, logits.device)] = True
    restricted = torch.zeros(B, 1, dtype=torch.bool, device=logits.device)
    restricted[rows] = True
    return logits.masked_fill(restricted & ~keep, NEG_INF)


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logit_bias`` (OpenAI): add the given value to the named tokens' logits."""
    rows = [b for b, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    V = logits.shape[1]
    items = [[(t, v) for t, v in params[b].logit_bias.items() if 0 <= t < V] for b in rows]
    r = torch.tensor([b for b, it in zip(rows, items) for _ in it], dtype=torch.long, device=logits.device)
    c = torch.tensor([t for it in items for t, _ in it], dtype=torch.long, device=logits.device)
    v = torch.tensor([x for it in items for _, x in it], dtype=logits.dtype, device=logits.device)
    return logits.index_put((r, c), v, accumulate=True)


def apply_repetition_penalty(logits: torch.Tensor, params: list[SamplingParams],
                             histories: list[tuple[Sequence[int], Sequence[int]]]) -> torch.Tensor:
    """Repetition penalty (Keskar et al. 2019, as transformers' RepetitionPenaltyLogitsProcessor): every token
    seen in prompt + output gets ``logit / rho`` when its logit is > 0, else ``logit * rho``."""
    rows = [b for b, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return logits
    B, V = logits.shape
    seen = token_counts(rows, [list(histories[b][0]) + list(histories[b][1]) for b in rows], B, V,
                        logits.device) > 0
    rho = torch.ones(B, 1, device=logits.device)
    rho[rows, 0] = torch.tensor([params[b].repetition_penalty for b in rows], device=logits.device)
    penalised = torch.where(logits > 0, logits / rho, logits * rho)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency(logits: torch.Tensor, params: list[SamplingParams],
                             outputs: list[Sequence[int]]) -> torch.Tensor:
    """Presence / frequency penalties (OpenAI), over OUTPUT tokens only:
    ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``."""
    rows = [b for b, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    if not rows:
        return logits
    B, V = logits.shape
    counts = token_counts(rows, [outputs[b] for b in rows], B, V, logits.device)
    pres = torch.zeros(B, 1, device=logits.device)
    freq = torch.zeros(B, 1, device=logits.device)
    pres[rows, 0] = torch.tensor([params[b].presence_penalty for b in rows], device=logits.device)
    freq[rows, 0] = torch.tensor([params[b].frequency_penalty for b in rows], device=logits.device)
    return logits - (freq * counts + pres * (counts > 0))


def apply_min_tokens(logits: torch.Tensor, params: list[SamplingParams], outputs: list[Sequence[int]],
                     eos_ids: set[int]) -> torch.Tensor:
    """``min_tokens`` (vLLM): EOS (unless ignore_eos) and ``stop_token_ids`` at -inf while fewer than
    ``min_tokens`` tokens were produced."""
    rows = [b for b, p in enumerate(params) if len(outputs[b]) < p.min_tokens]
    if not rows:
        return logits
    stops = [sorted(set(params[b].stop_token_ids) | (set() if params[b].ignore_eos else eos_ids)) for b in rows]
    r, c = _sparse(rows, stops, logits.shape[1], logits.device)
    if not r.numel():
        return logits
    return logits.index_put((r, c), torch.full((r.numel(),), NEG_INF, dtype=logits.dtype, device=logits.device))


def apply_processors(logits: torch.Tensor, params: list[SamplingParams],
                     histories: list[tuple[Sequence[int], Sequence[int]]], eos_ids: set[int],
                     vocab_size: int | None = None) -> torch.Tensor:
    """All logit processors in order; ``histories[b] = (prompt_ids, output_ids)``. Columns at or beyond
    ``vocab_size`` (padded embedding rows) are never chosen. Returns a new tensor."""
    if vocab_size is not None and logits.shape[1] > vocab_size:
        logits = logits.clone()
        logits[:, vocab_size:] = NEG_INF
    outputs = [h[1] for h in histories]
    logits = apply_allowed_tokens(logits, params)
    logits = apply_logit_bias(logits, params)
    logits = apply_repetition_penalty(logits, params, histories)
    logits = apply_presence_frequency(logits, params, outputs)
    return apply_min_tokens(logits, params, outputs, eos_ids)


class NGramPenalty:
    """FSD's anti-language-model (Yang et al. 2023, arXiv 2305.12675), as Inferflow's ``NGram`` class.

    An n-gram model over everything the sequence has seen (prompt + output). The penalty of candidate ``v``
    backs off from the longest context (n-1 tokens) to the empty one: for each context length i = n-1 .. 0
    whose continuation counts include v, ``score += remaining * beta * c(v) / (total + 1)`` (i > 0) or
    ``remaining * c(v) / total`` (i = 0), then ``remaining *= 1 - beta``. Levels where v never followed the
    context are skipped without decaying ``remaining`` (Inferflow's behaviour). No penalty at all while the
    history is shorter than n - 1 tokens.
    """

    __slots__ = ("n", "beta", "tokens", "_next")

    def __init__(self, n: int, beta: float):
        if n < 1:
            raise InferflowError(f"sampling: fsd_n = {n}; expected an integer >= 1")
        self.n, self.beta = n, beta
        self.tokens: list[int] = []
        # _next[i][context of i tokens] = Counter of the tokens that followed it
        self._next: list[dict[tuple[int, ...], Counter]] = [{} for _ in range(n)]

    def extend(self, new_tokens: Sequence[int]) -> None:
        for t in new_tokens:
            L = len(self.tokens)
            for i in range(min(self.n, L + 1)):
                key = tuple(self.tokens[L - i:]) if i else ()
                self._next[i].setdefault(key, Counter())[int(t)] += 1
            self.tokens.append(int(t))

    def sync(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """Catch up with a history that grew by output tokens (rebuilt if it is not a continuation)."""
        have, want = len(self.tokens), len(prompt_ids) + len(output_ids)
        if have > want or want - have > len(output_ids) or have < len(prompt_ids):
            self.tokens, self._next = [], [{} for _ in range(self.n)]
            self.extend(list(prompt_ids) + list(output_ids))
        elif want > have:
            self.extend(output_ids[len(output_ids) - (want - have):])

    def penalties(self, candidates: Sequence[int]) -> list[float]:
        if len(self.tokens) < self.n - 1:
            return [0.0] * len(candidates)
        out = []
        for cand in candidates:
            remaining, score = 1.0, 0.0
            for i in range(self.n - 1, -1, -1):
                key = tuple(self.tokens[len(self.tokens) - i:]) if i else ()
                following = self._next[i].get(key)
                c = following.get(int(cand), 0) if following else 0
                if not c:
                    continue
                total = sum(following.values())
                score += remaining * (c / total if i == 0 else self.beta * c / (total + 1))
                remaining -= remaining * self.beta
            out.append(score)
        return out
