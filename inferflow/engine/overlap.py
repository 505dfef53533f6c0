"""Overlapped decode steps (SGLang's overlap scheduler, vLLM's async scheduling) for pure-decode batches.

Synchronously, every step ends with the host waiting for the sampled tokens, then postprocessing them
(detokenize, stop checks, stream deltas), scheduling and staging the next step and launching it: the device
idles through all of that. Here, while the device runs step N, the host already enqueues step N+1 (the static
decode step of static_decode.py / cuda_graphs.py) whose token ids are gathered ON THE DEVICE from step N's
sampled tokens; its positions (+1), KV slots and block tables are staged ahead, and a block is allocated when a
position starts one. Only then does the host wait for step N's tokens (one non-blocking copy into pinned memory,
an event) and postprocess them, in the shadow of step N+1.

A sequence that stops at step N (EOS, a stop token id or string) has had one more token computed at step N+1:
that row is dropped when N+1 is committed (its blocks went back with the sequence; the stray K/V write went to a
slot of its own that no prefix-cache entry covers, and every later use of the block is queued behind it on the
same stream). Stops known ahead (max_tokens, max_model_len) are never scheduled. Step N+1 is committed (computed
tokens, newly full blocks offered to the prefix cache) only once step N's tokens are known, since the block
hashes need them.

Only a pure continuation overlaps: the same running sequences, nothing to admit or swap in, one token each
within the budget and the static step's size, and a sampling choice that needs no host state (``async_safe``).
Anything else resolves the step in flight, and the synchronous path runs (which may start a new overlapped run).
Greedy tokens and seeded samples are the synchronous path's: same step, same sampler operations, and a seeded
row draws from its own generator once per step either way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .request import Sequence
from .scheduler import Scheduled, SchedulerOutput
from .static_decode import decode_items, pure_decode


@dataclass(slots=True)
class InFlight:
    """A launched step whose tokens the host has not read yet."""

    seqs: list[Sequence]        # rows, in order
    pos: list[int]              # the position each row fed (its K/V is written there)
    tokens: torch.Tensor        # [n] sampled on the device (the next step's input)
    host: torch.Tensor          # [n] where they land on the host (pinned on CUDA)
    event: Any                  # CUDA event after the copy; None on the CPU (already there)


def async_safe(seq: Sequence) -> bool:
    """The sequence's next token can be chosen on the device alone (``Sampler.sample_tensor``) and its previous one
    need not be on the host: no penalties, bias, allowed ids, pending min_tokens (the sampler would count one
    token too few), logprobs, mirostat / FSD / EOS bypass (host state updated from the token), guides or beams;
    and it sampled before (a first sample forks ``n`` sequences)."""
    p, sq = seq.request.params, seq.sampling
    return (seq.sampled_before and sq is not None and sq.guide is None and seq.request.grammar is None
            and p.logprobs is None and not p.use_beam_search and p.fsd_alpha <= 0.0 and p.mirostat != 2
            and p.eos_bypass_max == 0 and not p.logit_bias and not p.allowed_token_ids
            and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and len(seq.output_ids) >= p.min_tokens)


class OverlapDecode:
    """The engine's overlapped decode: ``start`` launches a scheduled pure-decode batch without waiting for it;
    at the next step ``advance`` launches its continuation (when it is one) and then resolves it."""

    def __init__(self, engine: Any):
        self.eng = engine
        self.graphs = engine.runner.graphs
        self.inflight: InFlight | None = None
        dev = engine.model.device
        self.cuda = dev.type == "cuda"
        B = self.graphs.static.max_batch
        # two landing buffers / events: step N+1 copies into one while step N's is still read
        self._host = [torch.zeros(B, dtype=torch.long, pin_memory=self.cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if self.cuda else [None, None]
        self._flip = 0
        self.launches = 0          # overlapped steps launched (start + continuations)
        self.continuations = 0     # of which launched before the previous step's tokens were read
        self.discarded = 0         # tokens computed for sequences that had stopped

    @staticmethod
    def wanted(engine: Any) -> bool:
        on = engine.config.async_scheduling
        if on is None:
            on = engine.model.device.type == "cuda"
        return bool(on) and engine.runner.graphs is not None and engine.spec is None and not engine._multi_rank()

    # ---- launching ------------------------------------------------------------------------------
    def start(self, out: SchedulerOutput, touched: dict) -> bool:
        """Launch a scheduled batch overlapped when it qualifies (then commit it; its tokens are read by the next
        ``advance`` / ``resolve``); False: nothing was done, run it synchronously."""
        sched = out.scheduled
        if self.inflight is not None or not pure_decode(sched) or not all(async_safe(sc.seq) for sc in sched):
            return False
        items = decode_items(sched)
        if not self.graphs.fits(len(items), max(p for _, p, _ in items) + 1):
            return False
        try:
            rec = self._launch(items, None)
        except Exception:  # noqa: BLE001 - the synchronous path runs the batch again (and fails what fails)
            return False
        for sc in sched:
            touched.setdefault(sc.seq.request.request_id, sc.seq.request)
        self.eng.scheduler.commit(out)
        self.inflight = rec
        return True

    def advance(self, touched: dict) -> int | None:
        """With a step in flight: launch its continuation when it is one, then resolve the step in flight (its
        tokens postprocessed into ``touched``). Returns the rows launched, or None when nothing was (the step in
        flight is resolved either way: the caller goes on synchronously)."""
        cur = self.inflight
        nxt = self._continuation(cur)
        self.inflight = None
        self._resolve(cur, touched)
        if nxt is None:
            return None
        live = [(seq, p) for seq, p in zip(nxt.seqs, nxt.pos) if not seq.finished]
        if live:  # step N+1's K/V is written and step N's token known: commit (hashes of full blocks need it)
            self.eng.scheduler.commit(SchedulerOutput([Scheduled(seq, p, 1) for seq, p in live]))
            self.inflight = nxt  # its stopped rows are dropped when it resolves
        else:  # every row stopped at step N: nothing to read
            self.discarded += len(nxt.seqs)
        return len(nxt.seqs)

    def _continuation(self, cur: InFlight) -> InFlight | None:
        """Launch the step after ``cur`` when it is a pure continuation; None when it is not (nothing done)."""
        eng = self.eng
        sched, cfg = eng.scheduler, eng.config
        live = [i for i, seq in enumerate(cur.seqs) if not seq.finished]
        if not live or len(sched.running) != len(live) or sched.swapped or eng.embeddings.pending():
            return None
        if sched.waiting and self._may_admit(sched.waiting[0]):
            return None  # the synchronous scheduler would admit it (or fail it)
        rows, items = [], []
        for i in live:
            seq, p = cur.seqs[i], cur.pos[i] + 1
            if not async_safe(seq):
                return None
            mt = seq.request.params.max_tokens
            if (mt is not None and len(seq.output_ids) + 1 >= mt) or p + 1 >= eng.max_model_len:
                continue  # step N's token ends it ("length"): nothing to compute
            rows.append(i)
            items.append((seq, p, 0))
        if not items or len(items) > cfg.max_num_batched_tokens \
                or not self.graphs.fits(len(items), max(p for _, p, _ in items) + 1):
            return None
        bs, pool = eng.cache.block_size, eng.scheduler.pool
        need = [seq for seq, p, _ in items if p // bs >= len(seq.block_table)]
        if len(need) > pool.num_free:
            return None  # the synchronous scheduler preempts
        for seq in need:  # allocated now, before the position is written
            seq.block_table += pool.allocate(1)
        try:
            return self._launch(items, (cur.tokens, rows))
        except Exception:  # noqa: BLE001 - resolved and rerun synchronously (the new blocks stay with their sequences)
            return None

    def _may_admit(self, seq: Sequence) -> bool:
        """Whether the synchronous scheduler could admit (or fail) the head of the waiting queue now: a seat for it
        and the blocks of its tokens beyond what the prefix cache could at most supply (every full block but the
        last token's). A bound, never a miss: a backlog that cannot get in does not stop the overlap."""
        sched, pool = self.eng.scheduler, self.eng.scheduler.pool
        if sched._seats() + sched._seats_of(seq) > self.eng.config.max_num_seqs:
            return False
        n, bs = seq.num_tokens, sched.block_size
        blocks = -(-n // bs)
        if blocks > pool.num_blocks:
            return True  # it can never fit: failed at admission
        return blocks - ((n - 1) // bs if pool.enable_caching else 0) <= pool.num_free

    def _launch(self, items: list[tuple[Sequence, int, int]], feed: tuple[torch.Tensor, list[int]] | None) -> InFlight:
        seqs = [seq for seq, _, _ in items]
        logits = self.graphs.run(items, feed)
        tokens = self.eng.sampler.sample_tensor(logits, [seq.sampling for seq in seqs])
        n, k = len(seqs), self._flip
        self._flip ^= 1
        host, event = self._host[k][:n], self._events[k]
        if self.cuda:
            host.copy_(tokens, non_blocking=True)
            event.record()
        else:
            host = tokens
        self.launches += 1
        self.continuations += feed is not None
        return InFlight(seqs, [p for _, p, _ in items], tokens, host, event)

    # ---- resolving ------------------------------------------------------------------------------
    def _resolve(self, rec: InFlight, touched: dict) -> None:
        """Wait for a launched step's tokens and apply them as the synchronous sampler loop does."""
        if rec.event is not None:
            rec.event.synchronize()
        eng = self.eng
        for seq, tok in zip(rec.seqs, rec.host.tolist()):
            if seq.finished:  # stopped at the step before, aborted or failed since the launch
                self.discarded += 1
                continue
            req = seq.request
            touched.setdefault(req.request_id, req)
            try:
                eng._append(seq, tok, None, None)
            except Exception as e:  # noqa: BLE001 - e.g. a detokenizer error fails this request only
                eng._fail(seq, f"{type(e).__name__}: {e}", touched)
