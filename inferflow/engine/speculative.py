"""Speculative decoding inside the engine step: a small draft model (or prompt lookup, ``speculative_model =
"[ngram]"``: ngram.py) proposes ``k`` tokens per sequence, the target model checks all of them in the step's one
packed forward, and every accepted token costs no target pass of its own.

The draft's KV layers live in the SAME paged cache as the target's (keys renumbered past the target's, see
``prepare_draft``), so one block table serves both and prefix caching, swapping, recompute and copy-on-write
need nothing new. The draft stays in lock-step: it runs over every scheduled chunk of every sequence (its
first pass), so its K/V is valid wherever the target's is.

Per step, for each sequence whose chunk ends at its last token L-1 (and whose sampling is greedy or plain
random sampling; mirostat, FSD, EOS bypassing and beam search keep the normal path):
1. lookahead blocks for positions L..L+k-1 are taken from free blocks only (k shrinks, never preempts); the
   drafts come on top of ``max_num_batched_tokens`` (at most ``k`` per sequence), so how many tokens a
   sequence drafts, and hence a seeded request's draws, does not depend on the rest of the batch;
2. the draft proposes d_1..d_k: its first pass is the chunk itself (row L-1), then k-1 single-token passes,
   batched over the sequences;
3. the target runs the chunk plus the drafts (q_len = chunk + k) in the one packed forward, rows L-1..L+k-1;
4. greedy: d_j is accepted while it equals the target's argmax (of the same processed logits the sampler
   would use), then the target's own token follows, so the output is exactly non-speculative greedy.
   Sampled: standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023): accept d_j with
   probability min(1, p(d_j) / q(d_j)), on rejection draw from normalize(max(p - q, 0)), after k acceptances
   draw a bonus token from p; p and q are the sampler's distributions (processors, temperature, top-k/p,
   min-p, typical, tail-free) of each model given the same context. Seeded rows draw from their own generator.
5. rollback: the sequence's computed length becomes L + accepted (at most L + k - 1: the draft never saw
   d_k), blocks past it go back to the pool, and only fully computed blocks of accepted tokens are offered
   to the prefix cache (rejected tokens never reach a hashed block).
"""
from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import InferflowError
from .guided import is_guided
from .model_runner import ModelRunner
from .ngram import NGRAM, Lookup
from .postprocess import take_token
from .sampler import SeqSampling, _kind
from .scheduler import Scheduled, SchedulerOutput


def prepare_draft(model: Any, config: Any, draft: Any = None) -> Any:
    """The draft model for ``model`` (``draft``, else ``config.speculative_model`` loaded like the target), or
    None. The draft is adapted in place: only its first ``speculative_draft_layers`` decoder layers are kept, and
    its attention cache keys move past the target's so both share one paged KV cache."""
    if draft is not None and ngram_lookup(config):
        raise InferflowError('speculative decoding: a draft model with speculative_model "[ngram]" (no draft)')
    if draft is None:
        if not config.speculative_model or ngram_lookup(config):
            return None
        import inferflow

        draft = inferflow.load(config.speculative_model, dtype=model.dtype, device=model.device)
    if draft is model:
        raise InferflowError("speculative decoding: the draft must be a Model object of its own (load it again)")
    if draft.architecture != model.architecture or model.architecture == "encoder_only":
        raise InferflowError(f"speculative decoding: a {draft.architecture} draft for a {model.architecture} model")
    vt, vd = model.params.get("vocab_size"), draft.params.get("vocab_size")
    if vt != vd:
        raise InferflowError(f"speculative decoding: the draft's vocabulary ({vd}) differs from the model's ({vt})")
    n = config.speculative_draft_layers
    if n is not None:
        layers = draft.net.decoder.layers
        if n > len(layers):
            raise InferflowError(f"speculative_draft_layers = {n}; the draft has {len(layers)} decoder layers")
        # the first n layers with the final block and head: the same spec with fewer layers
        draft.net.decoder.layers = nn.ModuleList(list(layers)[:n])
    offset = 1 + max((m.cache_key for m in model.net.modules() if getattr(m, "uses_kv_cache", False)), default=-1)
    for i, m in enumerate(m for m in draft.net.modules() if getattr(m, "uses_kv_cache", False)):
        m.cache_key = offset + i
    return draft


def ngram_lookup(config: Any) -> bool:
    """Whether the proposals come from prompt lookup (ngram.py), not a draft model."""
    return config.speculative_model == NGRAM


def eligible(params: Any) -> bool:
    """Sampling the verification reproduces exactly: greedy or plain (truncated) random sampling. Guided requests
    take the normal path (their token choice depends on the matcher state each accepted draft would change)."""
    return not params.use_beam_search and params.eos_bypass_max == 0 and _kind(params) in ("greedy", "random") \
        and not is_guided(params)


@dataclass(slots=True)
class _Spec:
    """One speculating sequence of this step."""

    sc: Scheduled
    k: int
    drafts: list[int] = field(default_factory=list)
    q: list[torch.Tensor | None] = field(default_factory=list)   # the draft's distribution of each proposal (prompt
    #                                                              lookup: none, each proposal is certain)
    logits: torch.Tensor | None = None                           # the target's rows L-1 .. L+k-1

    def view(self, j: int) -> SeqSampling:
        """The sampler state as if the first ``j`` drafts were already output (no mutable state is shared)."""
        s = self.sc.seq.sampling
        return SeqSampling(s.params, s.prompt_ids, s.output_ids + self.drafts[:j], s.generator)


@dataclass(slots=True)
class SpecPlan:
    out: SchedulerOutput                 # everything scheduled (in order)
    plain: SchedulerOutput               # the part that takes the normal path
    specs: list[_Spec]


class Speculator:
    def __init__(self, engine: Any, draft: Any):
        """``draft``: the draft Model, or None for prompt lookup."""
        self.engine, self.draft = engine, draft
        self.k = engine.config.num_speculative_tokens
        self.runner: ModelRunner | None = None
        if draft is None:
            self.lookup = (engine.config.ngram_prompt_lookup_max, engine.config.ngram_prompt_lookup_min)
            return
        # the target's fast paths for the draft too (fused projections, prepacked CPU weights, the native decode
        # step, on CUDA chained graphs): its passes are ModelRunner.forward's, which replays a chained graph for a
        # pass of up to graph_prefill_tokens new tokens (a draft step's one token per sequence, short chunks).
        # Captured on first use: the draft never runs the pure-decode graphs that a capture at start would add.
        # No overlapped decode for the draft (that would give it a static step on the CPU too, never used)
        cfg = dataclasses.replace(engine.config, capture_graphs_at_start=False, async_scheduling=False)
        self.runner = ModelRunner(draft, engine.cache, cfg, engine.max_model_len)

    # ---- planning -------------------------------------------------------------------------------
    def plan(self, out: SchedulerOutput) -> SpecPlan:
        """Pick the speculating sequences and give them lookahead blocks (free ones only)."""
        eng = self.engine
        pool, bs = eng.cache.pool, eng.cache.block_size
        specs: list[_Spec] = []
        plain: list[Scheduled] = []
        for sc in out.scheduled:
            seq, p = sc.seq, sc.seq.request.params
            k = 0
            if sc.samples and (seq.sampled_before or p.n == 1) and eligible(p):
                left = p.max_tokens - len(seq.output_ids) if p.max_tokens is not None else self.k + 1
                k = min(self.k, left - 1, eng.max_model_len - seq.num_tokens)
                room = (len(seq.block_table) + pool.num_free) * bs - seq.num_tokens
                k = min(k, room)
            drafts: list[int] = []
            if k >= 1 and self.draft is None:
                if seq.lookup is None:
                    seq.lookup = Lookup()
                drafts = seq.lookup.propose(seq, k, *self.lookup)
            if self.draft is None:
                k = len(drafts)
            if k < 1:
                plain.append(sc)
                continue
            need = -(-(seq.num_tokens + k) // bs) - len(seq.block_table)
            seq.block_table += pool.allocate(max(need, 0))
            specs.append(_Spec(sc, k, drafts))
        return SpecPlan(out, SchedulerOutput(plain), specs)

    # ---- the forward passes ---------------------------------------------------------------------
    def forward(self, plan: SpecPlan) -> torch.Tensor:
        """Draft proposals, then the target's one packed pass; returns the plain rows' logits (the speculating
        sequences keep theirs)."""
        if self.runner is None and not plan.specs:  # prompt lookup found nothing: the normal step (decode graphs)
            return self.engine.runner.run(plan.out.scheduled)
        spec_of = {id(s.sc): s for s in plan.specs}
        chunk = lambda sc: sc.seq.tokens(sc.start, sc.start + sc.num_tokens)  # noqa: E731
        if self.runner is not None:
            # draft pass 1: every chunk (lock-step KV); rows only where a proposal starts
            rows = self.runner.forward([(sc.seq, sc.start, chunk(sc), int(id(sc) in spec_of))
                                        for sc in plan.out.scheduled])
            if plan.specs:
                self._propose(plan.specs, rows)
            for j in range(2, max((s.k for s in plan.specs), default=0) + 1):
                active = [s for s in plan.specs if s.k >= j]
                rows = self.runner.forward([(s.sc.seq, s.sc.seq.num_tokens + j - 2, [s.drafts[-1]], 1)
                                            for s in active])
                self._propose(active, rows)
        items = []
        for sc in plan.out.scheduled:
            s = spec_of.get(id(sc))
            items.append((sc.seq, sc.start, chunk(sc) + (s.drafts if s else []), s.k + 1 if s else int(sc.samples)))
        logits = self.engine.runner.forward(items)
        keep, r = [], 0
        for sc in plan.out.scheduled:
            s = spec_of.get(id(sc))
            n = s.k + 1 if s else int(sc.samples)
            if s:
                s.logits = logits[r:r + n]
            else:
                keep += range(r, r + n)
            r += n
        return logits[keep] if len(keep) != r else logits

    def _propose(self, specs: list[_Spec], logits: torch.Tensor) -> None:
        """One draft token per sequence from the draft's logits (greedy: argmax; else a draw from q)."""
        sampler = self.engine.sampler
        if sampler.vocab_size == 0:
            sampler.vocab_size = logits.shape[-1]
        views = [s.view(len(s.drafts)) for s in specs]
        x = sampler.process(logits.float(), views)
        toks = x.argmax(-1).tolist()
        q: list[torch.Tensor | None] = [None] * len(specs)
        rnd = [i for i, v in enumerate(views) if _kind(v.params) == "random"]
        if rnd:
            f = sampler.truncate(x[rnd], [views[i] for i in rnd])
            noise = sampler._noise([views[i] for i in rnd], f.shape[1], f.device)
            for i, tok, dist in zip(rnd, (f - noise.clamp_min(1e-30).log()).argmax(-1).tolist(), torch.softmax(f, -1)):
                toks[i], q[i] = tok, dist
        for s, tok, dist in zip(specs, toks, q):
            s.drafts.append(tok)
            s.q.append(dist)

    # ---- verification ---------------------------------------------------------------------------
    def verify(self, plan: SpecPlan, touched: dict[str, Any]) -> None:
        """Accept each speculating sequence's drafts, append the tokens, then roll back what was rejected."""
        eng = self.engine
        specs = [s for s in plan.specs if not s.sc.seq.finished]
        if not specs:
            return
        views = [s.view(j) for s in specs for j in range(s.k + 1)]
        logits = torch.cat([s.logits for s in specs]).float()
        try:
            x = eng.sampler.process(logits, views)
            rnd = [i for i, v in enumerate(views) if _kind(v.params) == "random"]
            probs = {}
            if rnd:
                p = torch.softmax(eng.sampler.truncate(x[rnd], [views[i] for i in rnd]), -1)
                probs = {i: p[n] for n, i in enumerate(rnd)}
            argmax = x.argmax(-1).tolist()
            raw_lp = torch.log_softmax(logits, -1) if any(s.sc.seq.logprobs is not None for s in specs) else None
        except Exception as e:  # noqa: BLE001 - a failing verification fails its requests, not the engine
            for s in specs:
                eng._fail(s.sc.seq, f"sampling failed: {type(e).__name__}: {e}", touched)
            return
        r = 0
        for s in specs:
            n = s.k + 1
            if not s.sc.seq.finished:
                try:
                    toks = self._accept(s, argmax[r:r + n], [probs.get(i) for i in range(r, r + n)])
                    if self.runner is None:
                        s.sc.seq.lookup.verified(len(toks) - 1)
                    self._apply(s, toks, None if raw_lp is None else raw_lp[r:r + len(toks)])
                except Exception as e:  # noqa: BLE001 - e.g. a detokenizer error fails this request only
                    eng._fail(s.sc.seq, f"{type(e).__name__}: {e}", touched)
            r += n

    def _accept(self, s: _Spec, argmax: list[int], p: list[torch.Tensor | None]) -> list[int]:
        """The accepted drafts plus the target's correction or bonus token."""
        c = self.engine.counters
        c.spec_draft_tokens += s.k
        if p[0] is None:  # greedy
            m = 0
            while m < s.k and s.drafts[m] == argmax[m]:
                m += 1
            c.spec_accepted_tokens += m
            return s.drafts[:m] + [argmax[m]]
        gen = s.sc.seq.sampling.generator
        shared = self.engine.sampler.generator
        g = gen if gen is not None else shared
        for j, d in enumerate(s.drafts):
            pj, qj = p[j], s.q[j] if s.q else None  # prompt lookup: q is all on d
            u = float(torch.rand((), generator=g, device=g.device if g is not None else pj.device))
            if u * (float(qj[d]) if qj is not None else 1.0) < float(pj[d]):
                continue
            c.spec_accepted_tokens += j
            if qj is None:
                qj = torch.zeros_like(pj)
                qj[d] = 1.0
            residual = (pj - qj).clamp_min(0.0)
            if float(residual.sum()) <= 0.0:  # p == q (to rounding): the residual is p itself
                residual = pj
            return s.drafts[:j] + [self._draw(residual, s)]
        c.spec_accepted_tokens += s.k
        return s.drafts + [self._draw(p[s.k], s)]

    def _draw(self, weights: torch.Tensor, s: _Spec) -> int:
        """A draw proportional to ``weights`` with the sampler's exponential race (the row's own generator)."""
        noise = self.engine.sampler._noise([s.sc.seq.sampling], weights.shape[0], weights.device)[0]
        return int((weights.log() - noise.clamp_min(1e-30).log()).argmax())

    def _apply(self, s: _Spec, toks: list[int], raw_lp: torch.Tensor | None) -> None:
        eng = self.engine
        seq, sc = s.sc.seq, s.sc
        L = seq.num_tokens
        lps, tops = None, None
        if raw_lp is not None:
            lps, tops = eng.sampler._logprobs(raw_lp, toks, [seq.request.params] * len(toks))
        end = None
        for i, tok in enumerate(toks):
            eng.counters.generation_tokens += 1
            end = take_token(seq, tok, lps[i] if lps else None, tops[i] if tops else None, eng.eos_ids,
                             eng.max_model_len)
            if end is not None:
                break
        seq.sampled_before = True
        # K/V of both models is valid up to the last accepted draft, and never past d_{k-1} (the draft's last pass;
        # prompt lookup has no draft K/V: the target's holds through d_k)
        computed = min(L + min(len(toks) - 1, s.k - (self.runner is not None)), seq.num_tokens)
        eng.scheduler.commit(SchedulerOutput([Scheduled(seq, sc.start, computed - sc.start)]))
        keep = -(-computed // eng.cache.block_size)
        if len(seq.block_table) > keep:  # the rejected tail's blocks (never hashed: past the computed tokens)
            eng.cache.pool.release(seq.block_table[keep:])
            del seq.block_table[keep:]
        if end is not None:
            eng._finish(seq, *end)
