"""Beam search in the engine, as HF transformers' ``generate(num_beams=k, do_sample=False)`` does it.

The beams of a request are its sequences: they run as ordinary decode rows of the engine's batches, sharing
KV blocks. A beam's next-token logits are kept until every live beam of its request has them (normally all
in the same step); a beam that has them while another is still missing (preempted, or left out by the token
budget) is parked: it leaves the scheduler and gives back its blocks (its full blocks stay in the prefix
cache), so the missing beams can run in a pool too small for all of them. Then, per request:
1. scores = processors(log_softmax(logits)) + each beam's cumulative log-probability (HF applies its logit
   processors to the log-probabilities); the best ``max(2, 1 + #eos) * k`` (beam, token) candidates;
2. a candidate ending in EOS (or a stop token id), or reaching the length limit, becomes a finished
   hypothesis if it ranks among the first ``k``, scored ``sum_logprobs / generated_len ** length_penalty``
   (generated_len counts the EOS); the best ``k`` hypotheses are kept per request;
3. the best ``k`` other candidates are the next beams: a child shares its parent's full blocks (incref)
   and the partial last block is taken over by the parent's first child and copied for the others
   (copy-on-write; with no free block, a child recomputes those few tokens instead);
4. the search ends when no candidate can continue (the length limit), when ``early_stopping`` is True and
   ``k`` hypotheses are done, or when the best running beam can no longer beat the worst kept hypothesis:
   ``best_running_sum / L ** length_penalty <= worst`` with L the current generated length (HF's heuristic
   for False) or the maximum one (``"never"`` with a positive length penalty).
The request then finishes with its best ``n`` hypotheses (EOS not included in ``token_ids``). Outputs are
not streamed before the end: beams are rewritten every step.

Children of parked parents are prefilled again (cheap when the prefix cache kept their blocks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InferflowError
from .block_pool import NoFreeBlocks
from .request import RequestStatus


def validate_beam(params: Any, max_num_seqs: int) -> None:
    """Refuse beam-search settings the engine cannot honour."""
    if not params.use_beam_search:
        return
    if params.beam_width > max_num_seqs:
        raise InferflowError(f"beam_width = {params.beam_width} exceeds max_num_seqs = {max_num_seqs}")
    if params.n > params.beam_width:
        raise InferflowError(f"n = {params.n} exceeds beam_width = {params.beam_width} (beam search returns the "
                             f"best n of its beams)")
    if params.stop:
        raise InferflowError("stop strings are not supported with beam search (use stop_token_ids)")


@dataclass(slots=True)
class Hypothesis:
    score: float                # sum of log-probabilities / generated_len ** length_penalty
    tokens: list[int]           # output tokens (without EOS)
    logprobs: list[float]       # raw log-probability of each output token
    finish_reason: str
    stop_reason: int | None = None


@dataclass(slots=True)
class BeamState:
    """A request's search state between steps (beams are ``request.seqs`` in this order)."""

    scores: list[float] = field(default_factory=lambda: [0.0])   # cumulative log-probability per beam
    logprobs: list[list[float]] = field(default_factory=lambda: [[]])
    finished: list[Hypothesis] = field(default_factory=list)     # best first, at most beam_width
    improvable: bool = True
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # id(beam) -> its next-token logits


class BeamSearch:
    def __init__(self, engine: Any):
        self.engine = engine

    def take(self, rows: list[Any], logits: torch.Tensor, touched: dict[str, Any]) -> tuple[list[Any], torch.Tensor]:
        """Run the beam step of every beam-search request among ``rows``; returns the other rows and logits."""
        groups: dict[int, list[int]] = {}
        rest = []
        for i, seq in enumerate(rows):
            if seq.request.params.use_beam_search:
                groups.setdefault(id(seq.request), []).append(i)
            else:
                rest.append(i)
        if not groups:
            return rows, logits
        for idx in groups.values():
            req = rows[idx[0]].request
            if req.beam is None:
                req.beam = BeamState()
            st = req.beam
            for i in idx:
                st.rows[id(rows[i])] = logits[i].clone()  # not a view: it may outlive this batch
            beams = req.unfinished_seqs
            if any(id(s) not in st.rows for s in beams):
                for i in idx:  # wait for the others without holding blocks
                    self.engine.scheduler.free(rows[i])
                    rows[i].num_computed, rows[i].status = 0, RequestStatus.PREEMPTED
                continue
            mine = torch.stack([st.rows.pop(id(s)) for s in beams])
            try:
                self._step(req, beams, mine)
            except Exception as e:  # noqa: BLE001 - a failing beam step fails its request only
                self.engine._fail(beams[0], f"beam search failed: {type(e).__name__}: {e}", touched)
        keep = [rows[i] for i in rest]
        return keep, (logits[rest] if len(rest) != len(rows) else logits)

    # ---- one step of one request ----------------------------------------------------------------
    def _step(self, req: Any, beams: list[Any], logits: torch.Tensor) -> None:
        eng, p = self.engine, req.params
        st: BeamState = req.beam
        k, lpen = p.beam_width, p.length_penalty
        raw = torch.log_softmax(logits.float(), -1)
        lp = eng.sampler.process(raw, [s.sampling for s in beams])  # HF: processors act on the log-probs
        V = lp.shape[1]
        eos = (set() if p.ignore_eos else set(eng.eos_ids)) | set(p.stop_token_ids)
        gen = len(beams[0].output_ids)  # all beams have the same length
        limit = eng.max_model_len - len(req.prompt_ids)
        limit = min(limit, p.max_tokens) if p.max_tokens is not None else limit
        total = (lp + torch.tensor(st.scores, dtype=lp.dtype, device=lp.device)[:, None]).flatten()
        top_v, top_i = total.topk(min(max(2, 1 + len(eos)) * k, total.numel()))
        running: list[tuple[int, int, float]] = []
        new: list[Hypothesis] = []
        for rank, (v, i) in enumerate(zip(top_v.tolist(), top_i.tolist())):
            b, t = divmod(i, V)
            at_eos = t in eos
            if at_eos or gen + 1 >= limit:
                if rank < k and v > -math.inf:
                    out = beams[b].output_ids + ([] if at_eos else [t])
                    lps = st.logprobs[b] + ([] if at_eos else [float(raw[b, t])])
                    new.append(Hypothesis(v / (gen + 1) ** lpen, out, lps, "stop" if at_eos else "length",
                                          t if at_eos and t in p.stop_token_ids else None))
            elif len(running) < k and v > -math.inf:
                running.append((b, t, v))
        # the best k hypotheses (stable: on a tie the earlier one stays ahead, as HF's merge keeps it)
        st.finished = sorted(st.finished + new, key=lambda h: -h.score)[:k]
        if running and len(st.finished) == k:
            best_len = limit if p.early_stopping == "never" and lpen > 0 else gen + 1
            if running[0][2] / best_len ** lpen <= st.finished[-1].score:
                st.improvable = False
        done = not running or not st.improvable or (len(st.finished) == k and p.early_stopping is True)
        if done:
            self._finish(req, beams, st)
        else:
            self._advance(req, beams, st, running, raw)

    def _advance(self, req: Any, beams: list[Any], st: BeamState, running: list[tuple[int, int, float]],
                 raw: torch.Tensor) -> None:
        """Rewrite the beams as the selected (parent, token) continuations, sharing the parents' blocks."""
        eng = self.engine
        pool, cache, bs = eng.cache.pool, eng.cache, eng.cache.block_size
        claimed: set[int] = set()
        states = []
        for b, t, v in running:
            par = beams[b]
            nc = par.num_computed  # a parked parent has 0: its children are prefilled again
            full = nc // bs
            table = par.block_table[:full]
            if nc % bs and b not in claimed:  # the first child takes over the partly filled last block
                claimed.add(b)
                table = par.block_table[:full + 1]
                pool.incref(table)
            elif nc % bs:  # the others copy it, or recompute its tokens when no block is free
                pool.incref(table)
                try:
                    own = pool.allocate(1)
                    cache.copy_blocks([par.block_table[full]], own)
                    table = table + own
                except NoFreeBlocks:
                    nc = full * bs
            else:
                pool.incref(table)
            states.append((par.output_ids + [t], table, nc, par.block_hashes[:full], min(par.num_registered, full),
                           st.logprobs[b] + [float(raw[b, t])], v))
        for s in beams:  # the parents' references (every block is held by its children by now, or freed)
            pool.release(s.block_table)
        while len(beams) < len(states):  # the first step forks the one prompt sequence into k beams
            kid = eng.intake.sequence(req, len(req.seqs))
            kid.admit()
            req.seqs.append(kid)
            beams.append(kid)
        sched = eng.scheduler
        parked = []
        for s, (out, table, nc, hashes, nreg, _, _) in zip(beams, states):
            s.output_ids[:] = out  # in place: the sampler state holds the same list
            s.block_table, s.num_computed, s.block_hashes, s.num_registered = table, nc, hashes, nreg
            s.sampled_before = True
            scheduled = s in sched.running
            if table and not scheduled:
                s.status = RequestStatus.RUNNING
                sched.running.append(s)
            elif not table:  # a parked parent's child: prefilled again, first in line
                if scheduled:
                    sched.running.remove(s)
                parked.append(s)
        for s in reversed(parked):
            sched.add(s, front=True)
        st.scores = [v for *_, v in states]
        st.logprobs = [lps for *_, lps, _ in states]
        eng.counters.generation_tokens += len(states)

    def _finish(self, req: Any, beams: list[Any], st: BeamState) -> None:
        """Free every beam; the request's sequences become its best ``n`` hypotheses."""
        eng = self.engine
        for s in beams:
            eng.scheduler.free(s)
        best = st.finished[:req.params.n]
        while len(req.seqs) < len(best):
            req.seqs.append(eng.intake.sequence(req, len(req.seqs)))
        del req.seqs[len(best):]
        for s, h in zip(req.seqs, best):
            s.output_ids[:] = h.tokens
            if s.detok is not None:
                s.text = "".join(s.detok.add(t) for t in h.tokens) + s.detok.flush()
            if s.logprobs is not None:
                s.logprobs = [{t: lp} for t, lp in zip(h.tokens, h.logprobs)]
            s.finish_reason, s.stop_reason = h.finish_reason, h.stop_reason
            s.status = RequestStatus.FINISHED
