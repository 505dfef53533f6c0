"""The batched sampler: logit processors, truncation samplers, mirostat, FSD, EOS bypassing, logprobs.

One call handles a whole decode batch ``[B, V]``. Per-row settings become ``[B]`` tensors once per call and every
stage runs on the whole group of rows with masks (a row that does not use a stage passes through unchanged).
The truncation samplers share ONE descending sort of the logits; mirostat is masked like the others; only FSD
loops over its rows (its n-gram penalty is a Python dictionary walk over a handful of candidates).

Randomness is an exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)`` i.i.d. per token is an exact sample from
``p`` (equivalently ``argmax(logit - log q)``, the Gumbel-max trick). Each seeded row draws its ``V`` numbers from
its own ``torch.Generator`` only, the same count every step, so its tokens do not depend on the rest of the batch
or on its row position; unseeded rows share the sampler's generator (or torch's default one).

The sampler mutates the per-sequence state it is given: ``mirostat_mu``, ``eos_bypassed`` and the FSD n-gram
model; the engine appends the returned token to ``output_ids``.

The parts: per-sequence state, the noise and the device transfer of per-row settings in sampling_state.py; the
truncation samplers in truncation.py; the logit processors in logits_processors.py; this file picks the tokens.
"""
from __future__ import annotations

import math

import torch

from ..native import cpu_ops
from .guided.constraint import pick_guided
from .logits_processors import NEG_INF, NGramPenalty, apply_processors
from .sampling_params import SamplingParams
# re-exported: their home was this module
from .sampling_state import GREEDY_BELOW, SampleOutput, SeqSampling, column, exp_noise, small_tensor  # noqa: F401
from .truncation import (min_p_filter, mirostat_filter, tail_free_filter, top_k_filter,  # noqa: F401
                         top_p_filter, truncate, typical_filter)


def _kind(p: SamplingParams) -> str:
    """Which path a row takes. FSD (fsd_alpha > 0) and mirostat (mirostat == 2) are their own samplers; greedy is
    the argmax of the processed logits (temperature < 1e-5, or top_k == 1); everything else draws from
    ``softmax(logits / temperature)`` (temperature sampling, Ackley et al. 1985) after the truncation stages."""
    if p.fsd_alpha > 0.0:
        return "fsd"
    if p.mirostat == 2:
        return "mirostat"
    if p.temperature < GREEDY_BELOW or p.top_k == 1:
        return "greedy"
    return "random"


def _plain_greedy(sq: SeqSampling) -> bool:
    """A greedy row no logit processor touches this step (no guide, no logprobs): its token is the raw argmax.
    Processed logits of such a row equal the raw ones, so the fast path picks exactly what ``process`` would."""
    p = sq.params
    return (sq.guide is None and p.logprobs is None and p.fsd_alpha <= 0.0 and p.mirostat != 2
            and (p.temperature < GREEDY_BELOW or p.top_k == 1) and not p.allowed_token_ids and not p.logit_bias
            and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and len(sq.output_ids) >= p.min_tokens)


class Sampler:
    """Chooses one token per row of a ``[B, V]`` logits batch; see the module docstring."""

    def __init__(self, vocab_size: int, eos_ids: set[int], *, generator: torch.Generator | None = None):
        self.vocab_size = vocab_size
        self.eos_ids = set(int(i) for i in eos_ids)
        self.generator = generator  # noise for unseeded rows; None: torch's default generator

    def __call__(self, logits: torch.Tensor, seqs: list[SeqSampling]) -> SampleOutput:
        B = logits.shape[0]
        logits = logits.float()
        params = [sq.params for sq in seqs]
        if all(_plain_greedy(sq) for sq in seqs):  # the common serving case: one argmax, one transfer
            x = self._plain(logits)
            idx = cpu_ops.argmax(x) if x.device.type == "cpu" else None  # torch's CPU argmax: ~125 us a vocab row
            out = (idx if idx is not None else x.argmax(-1)).tolist()
            self._bypass_eos(out, x, seqs)
            return SampleOutput(out, None, None)
        raw_lp = torch.log_softmax(logits, -1) if any(p.logprobs is not None for p in params) else None
        x = self.process(logits, seqs)

        kinds = [_kind(p) for p in params]
        guided = any(sq.guide is not None for sq in seqs)
        tokens, final, race, backup = self._race(x, seqs, kinds, guided)
        fsd = [b for b in range(B) if kinds[b] == "fsd"]
        if fsd:
            final = final.clone()
            for b in fsd:
                tokens[b], final[b] = self._fsd(x[b], seqs[b])

        out = tokens.tolist()
        if guided:  # constrained rows: the best VALID token by the same ranking (guided/constraint.py)
            pick_guided(out, race, backup, seqs)
        self._bypass_eos(out, final, seqs)
        self._update_mirostat(out, final, seqs, kinds)
        return SampleOutput(out, *self._logprobs(raw_lp, out, params))

    def sample_tensor(self, logits: torch.Tensor, seqs: list[SeqSampling]) -> torch.Tensor:
        """The tokens ``__call__`` picks, as a [B] tensor on the logits' device, without waiting for the device,
        for rows whose choice needs no host state (overlap.py's ``async_safe``: greedy or random rows without
        mirostat, FSD, EOS bypass, guides or logprobs). Same operations in the same order: the same tokens, and a
        seeded row draws the same noise from its generator."""
        logits = logits.float()
        if self.vocab_size == 0:
            self.vocab_size = logits.shape[-1]
        if all(_plain_greedy(sq) for sq in seqs):
            return self._plain(logits).argmax(-1)
        x = self.process(logits, seqs)
        return self._race(x, seqs, [_kind(sq.params) for sq in seqs], False)[0]

    def _plain(self, logits: torch.Tensor) -> torch.Tensor:
        """Raw logits with padded embedding rows never chosen (as apply_processors does)."""
        V = logits.shape[1]
        vocab = min(self.vocab_size or V, V)
        if V > vocab:
            logits = logits.clone()
            logits[:, vocab:] = NEG_INF
        return logits

    def _race(self, x: torch.Tensor, seqs: list[SeqSampling], kinds: list[str], guided: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy rows' argmax and random/mirostat rows' exponential race over processed logits ``x``: (tokens
        [B] on the device, each row's candidate scores (-inf = not a candidate, for EOS bypass), and for guided
        rows what the argmax ranks and the untruncated race)."""
        B, V = x.shape
        dev = x.device
        tokens = x.argmax(-1)            # greedy rows keep this
        final = race = backup = x
        rnd = [b for b in range(B) if kinds[b] in ("random", "mirostat")]
        if rnd:
            every = len(rnd) == B  # all rows draw: no gather/scatter of rows (same values, fewer copies)
            idx = None if every else small_tensor(rnd, dev)
            xr = x if every else x.index_select(0, idx)
            filtered = self.truncate(xr, seqs if every else [seqs[b] for b in rnd])
            q = self._noise(seqs if every else [seqs[b] for b in rnd], V, dev)
            put = (lambda base, rows: rows) if every else (lambda base, rows: base.index_copy(0, idx, rows))
            logq = q.clamp_min(1e-30).log()
            tokens = put(tokens, (filtered - logq).argmax(-1))
            final = put(final, filtered)
            if guided:
                temp = column([max(seqs[b].params.temperature, GREEDY_BELOW) for b in rnd], dev)
                race = put(x, filtered - logq)
                backup = put(x, xr / temp - logq)
        return tokens, final, race, backup

    def process(self, logits: torch.Tensor, seqs: list[SeqSampling]) -> torch.Tensor:
        """The logit processors' output for float32 ``logits`` (a row they mask entirely falls back to the raw
        logits); greedy picks its argmax, the samplers truncate it (speculative decoding scores drafts with it)."""
        V, dev = logits.shape[1], logits.device
        vocab = min(self.vocab_size or V, V)  # columns past the tokenizer's vocabulary are padding
        x = apply_processors(logits, [sq.params for sq in seqs], [(sq.prompt_ids, sq.output_ids) for sq in seqs],
                             self.eos_ids, vocab)
        dead = torch.isneginf(x).all(-1, keepdim=True)  # everything masked (e.g. allowed ids all EOS + min_tokens)
        # on an accelerator always take the (no-op for live rows) where: ``bool(dead.any())`` is a host sync
        if dev.type != "cpu" or bool(dead.any()):
            fallback = logits if V <= vocab else logits.masked_fill(torch.arange(V, device=dev) >= vocab, NEG_INF)
            x = torch.where(dead, fallback, x)
        return x

    def truncate(self, x: torch.Tensor, seqs: list[SeqSampling]) -> torch.Tensor:
        """The logits each (random or mirostat) row samples from (truncation.py's ``truncate``)."""
        return truncate(x, seqs)

    def _noise(self, seqs: list[SeqSampling], V: int, dev: torch.device) -> torch.Tensor:
        """``[n, V]`` Exp(1) draws: a seeded row from its own generator only (V draws every step)."""
        return exp_noise(seqs, V, dev, self.generator)

    def _fsd(self, x: torch.Tensor, sq: SeqSampling) -> tuple[torch.Tensor, torch.Tensor]:
        """Frustratingly Simple Decoding (Yang et al. 2023, arXiv 2305.12675; Inferflow's ``fsd``): the top-k
        candidates of ``p = softmax(logits / T)`` are scored ``(1 - alpha) * p - alpha * penalty`` with the
        n-gram anti-LM penalty over prompt + output (back-off beta), and the best score wins (deterministic).
        Inferflow takes p over a 50-token pool; here p is over the whole vocabulary, as in the paper."""
        p = sq.params
        probs = torch.softmax(x / (p.temperature if p.temperature >= GREEDY_BELOW else 1.0), -1)
        top, cand = probs.topk(max(1, min(p.fsd_k, x.shape[0])))
        if sq.fsd_ngram is None or sq.fsd_ngram.n != p.fsd_n:
            sq.fsd_ngram = NGramPenalty(p.fsd_n, p.fsd_beta)
        sq.fsd_ngram.sync(sq.prompt_ids, sq.output_ids)
        pen = torch.tensor(sq.fsd_ngram.penalties(cand.tolist()), dtype=top.dtype, device=top.device)
        score = ((1 - p.fsd_alpha) * top - p.fsd_alpha * pen).masked_fill(top <= 0, NEG_INF)
        row = torch.full_like(x, NEG_INF).scatter_(0, cand, score)
        return cand[score.argmax()], row

    def _bypass_eos(self, tokens: list[int], final: torch.Tensor, seqs: list[SeqSampling]) -> None:
        """Inferflow's EOS bypassing: up to ``eos_bypass_max`` times per sequence, a chosen EOS is replaced by
        the best non-EOS candidate of that row (kept by its samplers; for greedy rows any token). Nothing
        happens when EOS was the only candidate."""
        rows = [b for b, t in enumerate(tokens) if t in self.eos_ids
                and seqs[b].eos_bypassed < seqs[b].params.eos_bypass_max]
        if not rows:
            return
        V = final.shape[1]
        cand = final[rows].clone()
        cand[:, [e for e in self.eos_ids if e < V]] = NEG_INF
        best_val, best = cand.max(-1)
        for i, b in enumerate(rows):
            if math.isfinite(float(best_val[i])):
                tokens[b] = int(best[i])
                seqs[b].eos_bypassed += 1

    def _update_mirostat(self, tokens: list[int], final: torch.Tensor, seqs: list[SeqSampling],
                         kinds: list[str]) -> None:
        """mu <- mu - eta * (surprise - tau), surprise = -log2 of the chosen token's probability in the truncated,
        renormalised distribution it was drawn from (llama.cpp / Inferflow)."""
        rows = [b for b, k in enumerate(kinds) if k == "mirostat"]
        if not rows:
            return
        chosen = torch.tensor([[tokens[b]] for b in rows], device=final.device)
        lp = torch.log_softmax(final[rows], -1).gather(1, chosen)
        for b, v in zip(rows, lp[:, 0].tolist()):
            p = seqs[b].params
            seqs[b].mirostat_mu -= p.mirostat_eta * (-v / math.log(2.0) - p.mirostat_tau)

    def _logprobs(self, raw_lp: torch.Tensor | None, tokens: list[int], params: list[SamplingParams]
                  ) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
        """log_softmax of the raw model logits (vLLM's default): chosen token and the top-N per row."""
        if raw_lp is None:
            return None, None
        chosen = raw_lp.gather(1, torch.tensor(tokens, device=raw_lp.device)[:, None])[:, 0].tolist()
        n_max = max((p.logprobs or 0) for p in params)
        top: list[list[tuple[int, float]]] = [[] for _ in params]
        if n_max > 0:
            vals, ids = raw_lp.topk(min(n_max, raw_lp.shape[1]), dim=-1)
            vals, ids = vals.tolist(), ids.tolist()
            for b, p in enumerate(params):
                top[b] = list(zip(ids[b][:p.logprobs or 0], vals[b][:p.logprobs or 0]))
        return chosen, top
