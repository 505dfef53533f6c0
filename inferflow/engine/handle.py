"""A submitted request as its caller sees it: a stream of RequestOutput deltas, sync or async.

Outputs go into the request's ``OutputStream`` from whichever thread runs ``Engine.step``. A handle read
without the engine's background thread drives ``step()`` itself; with it, the handle just waits. Async
readers get an asyncio queue fed through ``loop.call_soon_threadsafe`` (the step thread never touches the
event loop directly).
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import Any, AsyncIterator, Iterator

from ..errors import InferflowError
from .outputs import RequestOutput


class OutputStream:
    """Thread-safe queue of a request's outputs; switches to an asyncio queue once read asynchronously."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aq: asyncio.Queue | None = None

    def put(self, item: Any) -> None:
        with self._lock:
            if self._aq is not None:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, item)
            else:
                self._q.put(item)

    def get(self, timeout: float | None = None) -> Any:
        """The next item, or None (immediately when timeout is 0, else after ``timeout`` seconds)."""
        try:
            return self._q.get(block=bool(timeout), timeout=timeout or None)
        except queue.Empty:
            return None

    def attach(self, loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        """From now on deliver to an asyncio queue on ``loop`` (called on the loop's thread)."""
        with self._lock:
            if self._aq is None:
                self._loop, self._aq = loop, asyncio.Queue()
                while True:
                    try:
                        self._aq.put_nowait(self._q.get_nowait())
                    except queue.Empty:
                        break
            return self._aq


class RequestHandle:
    """Iterate for output deltas (each RequestOutput also carries the cumulative text and tokens),
    ``async for`` in a service, ``result()`` for the final output, ``cancel()`` to abort."""

    def __init__(self, engine: Any, request: Any):
        self._engine, self._request = engine, request
        self.request_id: str = request.request_id
        self._last: RequestOutput | None = None
        self._done = False

    @property
    def finished(self) -> bool:
        return self._done

    def _got(self, item: RequestOutput) -> RequestOutput:
        self._last = item
        self._done = item.finished
        return item

    def _next(self) -> RequestOutput:
        stream, engine = self._request.stream, self._engine
        while True:
            item = stream.get(0)
            if item is not None:
                return self._got(item)
            if engine.background:
                item = stream.get(0.1)
                if item is not None:
                    return self._got(item)
            elif not engine.step() and not engine.has_unfinished() and stream.get(0) is None:
                raise InferflowError(f"request {self.request_id}: the engine has no work left for it")

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self._done:
            yield self._next()

    async def _aiter(self) -> AsyncIterator[RequestOutput]:
        engine = self._engine
        aq = self._request.stream.attach(asyncio.get_running_loop())
        while not self._done:
            if not aq.empty():
                yield self._got(aq.get_nowait())
            elif engine.background:
                # not asyncio.wait_for: before Python 3.12 it can swallow a cancellation that arrives as the item
                # does, and a reader whose client left would then read the request to its end
                getter = asyncio.ensure_future(aq.get())
                try:
                    done, _ = await asyncio.wait({getter}, timeout=0.5)
                except BaseException:
                    getter.cancel()
                    raise
                if not done:
                    getter.cancel()  # an unfinished get leaves its item in the queue
                    continue  # look again whether the step thread still runs
                yield self._got(getter.result())
            elif getattr(engine, "failure", None):  # the step thread died: take its last outputs, never step here
                await asyncio.sleep(0)  # outputs it queued via call_soon_threadsafe land first
                if aq.empty():
                    raise InferflowError(f"request {self.request_id}: the engine stopped: {engine.failure}")
            else:  # no step thread: run a step off the event loop, then look again
                worked = await asyncio.to_thread(engine.step)
                await asyncio.sleep(0)  # outputs queued via call_soon_threadsafe land first
                if not worked and not engine.has_unfinished() and aq.empty():
                    raise InferflowError(f"request {self.request_id}: the engine has no work left for it")

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._aiter()

    def result(self) -> RequestOutput:
        """Wait for the end; the final output (cumulative text, tokens and finish reasons)."""
        for _ in self:
            pass
        return self._last

    async def aresult(self) -> RequestOutput:
        async for _ in self:
            pass
        return self._last

    def cancel(self) -> None:
        """Abort the request: its blocks are freed and a final output with finish_reason "abort" follows."""
        self._engine.abort(self.request_id)
