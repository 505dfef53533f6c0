"""The engine's request API: queueing a request (refused with ``Overloaded`` when the waiting queue is full),
aborting one, and ``generate``, which runs prompts to completion pacing itself on a full queue. A mixin of
:class:`~inferflow.engine.engine.Engine`, which owns the state used here and runs the steps.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Sequence as Seq

from ..errors import InferflowError
from .handle import RequestHandle
from .outputs import RequestOutput
from .request import Request
from .sampling_params import SamplingParams


class Overloaded(InferflowError):
    """The waiting queue is full: the request was refused (retry later)."""


class RequestAPI:
    _requests: dict[str, Request]
    _inbox: deque[Request]
    _aborts: list[str]
    _lock: threading.Lock
    _step_lock: threading.RLock
    _wake: threading.Event
    _ids: Any
    config: Any
    counters: Any
    intake: Any
    scheduler: Any
    embeddings: Any

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, encoder_prompt: str | Seq[int] | None = None,
                    cache_salt: str | None = None) -> RequestHandle:
        """Queue a request (thread-safe). Bad input fails the request (finish_reason "error"), not the call;
        a full waiting queue raises ``Overloaded``."""
        params = params or SamplingParams()
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        req = self.intake.request(rid, prompt, params, encoder_prompt, cache_salt)
        with self._lock:
            if rid in self._requests:
                raise InferflowError(f"request id {rid!r} is already in use")
            waiting = len(self._inbox) + len(self.scheduler.waiting)
            if waiting >= self.config.max_waiting:
                self.counters.requests_rejected += 1
                raise Overloaded(f"engine overloaded: {waiting} requests are waiting (max_waiting = "
                                 f"{self.config.max_waiting}); retry later")
            self._requests[rid] = req
            self._inbox.append(req)
        self._wake.set()
        return RequestHandle(self, req)

    def abort(self, request_id: str) -> None:
        """Cancel a request (thread-safe): its blocks are freed, its handle gets a final "abort" output."""
        if self._step_lock.acquire(blocking=False):
            try:
                self._abort_now(request_id)
            finally:
                self._step_lock.release()
        else:  # a step is running: apply at the start of the next one
            with self._lock:
                self._aborts.append(request_id)
            self._wake.set()

    def _abort_now(self, request_id: str) -> None:
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                return
            if req in self._inbox:
                self._inbox.remove(req)
        req.aborted = True
        for seq in req.unfinished_seqs:
            self._finish(seq, "abort")
        self._emit(req)

    def has_unfinished(self) -> bool:
        return bool(self._requests) or self.embeddings.pending()

    def generate(self, prompts: str | Seq[int] | Seq[str | Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (a flat list of ints is one prompt); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        handles = []
        for prompt, p in zip(prompts, plist):
            while True:
                try:
                    handles.append(self.add_request(prompt, p))
                    break
                except Overloaded:  # pace ourselves: let the queue drain
                    self._wait_a_step()
        return [h.result() for h in handles]

    def _wait_a_step(self) -> None:
        if self.background:
            time.sleep(0.005)
        else:
            self.step()
