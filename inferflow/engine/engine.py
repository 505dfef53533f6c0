"""The engine: the one place requests run. Requests come in at any time; each ``step()`` runs one forward pass
over the scheduler's batch (or one encoder batch of embedding requests), samples, detokenizes, checks stops and
streams the deltas to the requests' handles. ``start()`` runs the steps on a background thread.
The request API (``add_request``, ``abort``, ``generate``) is a mixin (request_api.py), as is the background
thread (background.py).
"""
from __future__ import annotations

import atexit
import itertools
import threading
import time
import weakref
from collections import deque
from typing import Any, Sequence as Seq

import torch

from ..model.placement import place_embeddings
from .background import BackgroundStepping
from .beam import BeamSearch
from .config import EngineConfig
from .embedding import EmbeddingQueue
from .fill_mask import FillMaskOutput
from .intake import RequestIntake
from .metrics import EngineCounters, render_prometheus, snapshot
from .model_runner import ModelRunner
from .outputs import RequestOutput
from .overlap import OverlapDecode
from .postprocess import changed, close_text, delta_output, take_token
from .profiling import StepLog, StepProfiler
from .request import Request, RequestStatus, Sequence
from .request_api import Overloaded, RequestAPI  # noqa: F401 - Overloaded: re-exported (its home was here)
from .sampler import Sampler
from .scheduler import Scheduler, SchedulerOutput
from .sizing import build_cache, max_model_len
from .speculative import Speculator, ngram_lookup, prepare_draft


class Engine(RequestAPI, BackgroundStepping):
    def __init__(self, model: Any, config: EngineConfig | None = None, draft: Any = None):
        """``draft``: a speculative-decoding draft Model (else ``config.speculative_model`` names one, or none)."""
        self.model, self.config = model, config or EngineConfig()
        self.tokenizer = model.tokenizer
        self.eos_ids = model._stop_ids()
        self.max_model_len = max_model_len(model, self.config)
        vocab = model.params.get("vocab_size")
        if self.config.host_embeddings:  # before the KV cache is allocated: the tables' VRAM is freed first
            place_embeddings(model)
        self.draft = prepare_draft(model, self.config, draft)  # its KV shares the cache's blocks
        self.cache = build_cache(model, self.config, self.max_model_len, self.draft)
        self.scheduler = Scheduler(self.config, self.cache)
        self.runner = ModelRunner(model, self.cache, self.config, self.max_model_len)
        gen = torch.Generator(device=model.device).manual_seed(self.config.seed)
        self.sampler = Sampler(vocab or 0, self.eos_ids, generator=gen)
        self.counters = EngineCounters()
        # the helpers see the engine through a weak proxy: no reference cycle through it, so a dropped engine
        # frees its KV cache and graphs at once, by reference counting, even after the graph capture's gc.freeze()
        # has put every object of the process out of the cycle collector's reach
        me = weakref.proxy(self)
        self.embeddings = EmbeddingQueue(me)
        self.intake = RequestIntake(model, self.config, self.max_model_len)
        self.spec = Speculator(me, self.draft) if self.draft is not None or ngram_lookup(self.config) else None
        self.beams = BeamSearch(me)
        self.profiler = StepProfiler.from_env()  # a trace of a few steps ($INFERFLOW_PROFILE_DIR)
        self.step_log = StepLog.from_env()       # a line per step ($INFERFLOW_STEP_LOG)
        if self.step_log is not None:
            atexit.register(self.step_log.flush)
        # pure-decode steps launched before the previous one's tokens are read (overlap.py)
        self.overlap = OverlapDecode(me) if OverlapDecode.wanted(self) else None
        self._requests: dict[str, Request] = {}
        self._inbox: deque[Request] = deque()
        self._aborts: list[str] = []
        self._lock = threading.Lock()           # inbox, aborts, request ids
        self._step_lock = threading.RLock()     # one step at a time
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: str | None = None        # why the background thread died (None while it runs or never ran)
        self._ids = itertools.count()

    @property
    def background(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[Any]:
        """Run one engine step; returns the RequestOutputs (and EmbeddingOutputs) it produced."""
        with self._step_lock:
            if self.profiler is not None:
                self.profiler.tick()
            t0 = time.perf_counter()
            emitted: list[Any] = []
            touched = self._drain()
            ov = self.overlap
            if ov is not None and ov.inflight is not None:  # launch the next step, then read the one in flight
                launched = ov.advance(touched)
                if launched is not None:
                    self._account(t0, launched, launched, launched)
                    return [self._emit(r) for r in touched.values() if changed(r)]
            if self.embeddings.pending() and (not self.scheduler.has_work() or not self.embeddings.ran_last):
                emitted += self.embeddings.run_batch()
                self._account(t0, 0)
                return [self._emit(r) for r in touched.values()] + emitted
            self.embeddings.ran_last = False
            out = self.scheduler.schedule()
            for seq, msg in out.failed:
                self._fail(seq, msg, touched)
            # a failure ends every sequence of its request, some of which may be scheduled
            out.scheduled = [sc for sc in out.scheduled if not sc.seq.finished]
            if out.scheduled:
                if ov is None or not ov.start(out, touched):
                    self._run(out, touched)
                self._account(t0, out.num_tokens, len(out.scheduled),
                              sum(sc.num_tokens == 1 for sc in out.scheduled))
            return [self._emit(r) for r in touched.values() if changed(r)]

    def _drain(self) -> dict[str, Request]:
        """Move new requests to the scheduler (failing the invalid ones) and apply queued aborts."""
        touched: dict[str, Request] = {}
        with self._lock:
            new, self._inbox = list(self._inbox), deque()
            aborts, self._aborts = self._aborts, []
        for req in new:
            if req.error is not None:
                self._fail(req.seqs[0], req.error, touched)
                continue
            self.counters.requests_added += 1
            self.counters.prompt_tokens += len(req.prompt_ids)
            self.scheduler.add(req.seqs[0])
        for rid in aborts:
            self._abort_now(rid)
        return touched

    def _run(self, out: SchedulerOutput, touched: dict[str, Request]) -> None:
        """The forward pass and the sampling of one scheduled batch; failures fail the batch's requests."""
        for sc in out.scheduled:
            touched.setdefault(sc.seq.request.request_id, sc.seq.request)
        spec = self.spec.plan(out) if self.spec is not None else None  # speculating sequences leave ``plain``
        plain = out if spec is None else spec.plain
        try:
            logits = self.runner.run(out.scheduled) if spec is None else self.spec.forward(spec)
        except Exception as e:  # noqa: BLE001 - a failing batch fails its requests, not the engine
            if spec is not None or len(out.scheduled) < 2 or self._multi_rank():
                for sc in out.scheduled:
                    self._fail(sc.seq, f"forward pass failed: {type(e).__name__}: {e}", touched)
                return
            logits = self._run_alone(out, touched)
            if logits is None:
                return
        self.scheduler.commit(plain)
        count = self.counters.count_chunk
        for sc in out.scheduled:
            seq = sc.seq
            plen, end = len(seq.request.prompt_ids), sc.start + sc.num_tokens
            if sc.num_tokens == 1 and sc.start >= plen and end == seq.num_tokens:
                continue  # a plain decode: neither prefill nor recompute (count_chunk would add 0 and 0)
            count(sc.start, end, plen, seq.num_tokens)
        if spec is not None:
            self.spec.verify(spec, touched)
        rows = [sc.seq for sc in plain.scheduled if sc.samples]
        if rows:
            self._sample(rows, logits, touched)

    def _run_alone(self, out: SchedulerOutput, touched: dict[str, Request]) -> torch.Tensor | None:
        """After a batch's forward pass failed, each sequence alone (rewriting the same KV slots with the same
        values): only requests whose own pass fails are failed, the rest of the batch goes on (``out.scheduled``
        keeps them). Their logits in order, or None when none is left."""
        kept = []
        for sc in out.scheduled:
            if sc.seq.finished:  # a sibling sequence (n > 1) failed its request already
                continue
            try:
                kept.append((sc, self.runner.run([sc])))
            except Exception as e:  # noqa: BLE001
                self._fail(sc.seq, f"forward pass failed: {type(e).__name__}: {e}", touched)
        kept = [(sc, rows) for sc, rows in kept if not sc.seq.finished]
        out.scheduled = [sc for sc, _ in kept]
        return torch.cat([rows for _, rows in kept]) if kept else None

    def _sample(self, rows: list[Sequence], logits: torch.Tensor, touched: dict[str, Request]) -> None:
        """One sampler call for every row; a request's first sample forks its n sequences from one row."""
        rows, logits = self.beams.take(rows, logits, touched)  # beam-search rows take their own step
        if not rows:
            return
        targets: list[tuple[Sequence, Sequence | None]] = []   # (sequence, parent to fork from)
        index: list[int] = []
        # steady state (every row sampled before): nothing forks, one target per row (set below)
        for r, seq in enumerate(rows) if not all(seq.sampled_before for seq in rows) else ():
            group = [(seq, None)]
            if not seq.sampled_before and seq.index == 0 and seq.request.params.n > 1:
                kids = [self.intake.sequence(seq.request, i) for i in range(1, seq.request.params.n)]
                seq.request.seqs += kids
                group += [(kid, seq) for kid in kids]
            for s, _ in group:
                s.sampled_before = True
            targets += group
            index += [r] * len(group)
        if not targets:
            targets, index = [(seq, None) for seq in rows], list(range(len(rows)))
        if len(index) != len(rows):
            logits = logits[torch.tensor(index, device=logits.device)]
        if self.sampler.vocab_size == 0:
            self.sampler.vocab_size = logits.shape[-1]
        try:
            res = self.sampler(logits, [s.sampling for s, _ in targets])
        except Exception as e:  # noqa: BLE001
            for s, _ in targets:
                self._fail(s, f"sampling failed: {type(e).__name__}: {e}", touched)
            return
        for seq, parent in targets:  # fork before any token can finish (and free) a parent
            if parent is not None:
                self.scheduler.fork(parent, seq)
        lps, tops = res.logprobs, res.top_logprobs
        for i, (seq, parent) in enumerate(targets):
            if seq.finished:  # its request failed on an earlier row
                continue
            try:
                self._append(seq, res.tokens[i], None if lps is None else lps[i], None if tops is None else tops[i])
            except Exception as e:  # noqa: BLE001 - e.g. a detokenizer error fails this request only
                self._fail(seq, f"{type(e).__name__}: {e}", touched)

    def _append(self, seq: Sequence, tok: int, logprob: float | None, top: list | None) -> None:
        self.counters.generation_tokens += 1
        end = take_token(seq, tok, logprob, top, self.eos_ids, self.max_model_len)
        if end is not None:
            self._finish(seq, *end)

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        seq.finish_reason, seq.stop_reason = reason, close_text(seq, reason, stop_reason)
        seq.status = RequestStatus.FINISHED
        self.scheduler.free(seq)

    def _fail(self, seq: Sequence, message: str, touched: dict[str, Request]) -> None:
        """Fail a sequence's whole request (its other sequences too): blocks freed, the error reported."""
        req = seq.request
        req.error = req.error or message
        for s in req.unfinished_seqs:
            self._finish(s, "error")
        touched[req.request_id] = req

    # ---- outputs --------------------------------------------------------------------------------
    def _emit(self, req: Request) -> RequestOutput:
        """The request's delta output: pushed to its stream; a finished request leaves the engine."""
        ro = delta_output(req)
        if req.finished:
            with self._lock:
                if self._requests.pop(req.request_id, None) is not None:
                    c = self.counters
                    c.requests_finished += 1
                    c.requests_failed += req.error is not None
                    c.requests_aborted += req.aborted
            req.cross = {}
        req.stream.put(ro)
        return ro

    def _account(self, t0: float, tokens: int, rows: int = 0, decode: int = 0) -> None:
        c = self.counters
        c.steps += 1
        c.last_step_time_seconds = time.perf_counter() - t0
        c.step_time_seconds_total += c.last_step_time_seconds
        c.last_step_tokens = tokens
        if self.step_log is not None:
            self.step_log.record(t0, c.last_step_time_seconds, tokens, rows, decode)

    # ---- conveniences ---------------------------------------------------------------------------
    def embed(self, texts: str | Seq[str] | Seq[Seq[int]]) -> torch.Tensor:
        """Pooled embeddings [n, hidden] float32, computed by encoder batches of the engine."""
        return self.embeddings.embed(texts)

    def fill_mask(self, texts: str | Seq[str] | Seq[Seq[int]], top_k: int = 5,
                  mask_token_id: int | None = None) -> list[FillMaskOutput]:
        """Masked-LM scores (encoder-only models with an MLM head), computed by encoder batches of the engine:
        per input, the ``top_k`` (rank, token, id, score) at each mask position (fill_mask.py)."""
        return self.embeddings.fill_mask(texts, top_k, mask_token_id)

    def metrics(self) -> dict[str, Any]:
        m = snapshot(self.counters, self.scheduler)
        m["waiting"] += len(self._inbox)
        m["waiting_embeddings"] = self.embeddings.pending()
        return m

    def metrics_text(self, labels: dict[str, str] | None = None) -> str:
        """The metrics in Prometheus text format."""
        return render_prometheus(self.metrics(), labels=labels)
