"""The engine's background thread (the service's mode): steps whenever there is work, fails the requests in flight
when a step raises, and records why the thread died (``failure``: a service's /health reports it). A mixin of
:class:`~inferflow.engine.engine.Engine`, which owns the state used here."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .request import Request


class BackgroundStepping:
    _thread: threading.Thread | None
    failure: str | None
    model: Any

    def start(self) -> None:
        """Step on a background thread (the service's mode); handles then only wait for outputs."""
        if self.background:
            return
        self._stopping, self.failure = False, None
        self._thread = threading.Thread(target=self._loop, name="inferflow-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the background thread (unfinished requests stay; handles can drive them)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self._thread = None
        if self.profiler is not None:  # fewer steps than asked ran: write what was recorded
            self.profiler.finish()

    def _has_work(self) -> bool:
        return bool(self._inbox or self._aborts or self.scheduler.has_work() or self.embeddings.pending())

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                if not self._has_work():
                    self._wake.wait(0.1)
                    continue
                try:
                    self.step()
                except Exception as e:  # noqa: BLE001 - an engine bug: fail what is in flight rather than hang clients
                    if self._multi_rank():
                        raise  # a rank lost or out of step: no later step can line up; fatal (``failure``)
                    self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
        except BaseException as e:  # the thread dies: say why (a service's /health reports it), fail what is in flight
            self.failure = f"{type(e).__name__}: {e}"
            self._fail_all(f"engine thread stopped: {self.failure}")
            raise

    def _multi_rank(self) -> bool:
        """Whether other processes replay this engine's steps (a parallel placement): a failed step, or a batch
        retried sequence by sequence, would leave their collectives out of step."""
        placement = getattr(self.model, "placement", None)
        return getattr(placement, "world_size", 1) > 1

    def _fail_all(self, message: str) -> None:
        with self._step_lock:
            touched: dict[str, Request] = {}
            for req in list(self._requests.values()):
                self._fail(req.seqs[0], message, touched)
            for req in touched.values():
                self._emit(req)
