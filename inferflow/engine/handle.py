"""A submitted request as its caller sees it: a stream of RequestOutput deltas, sync or async.

Outputs go into the request's ``OutputStream`` from whichever thread runs ``Engine.step``. A handle read
without the engine's background thread drives ``step()`` itself; with it, the handle just waits. Async
readers get the outputs through ``LoopDelivery``: one ``loop.call_soon_threadsafe`` per burst of outputs (the
step thread never touches the event loop directly).
"""
from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections import deque
from typing import Any, AsyncIterator, Iterator

from ..errors import InferflowError
from .outputs import RequestOutput


class LoopDelivery:
    """Hands outputs from the step thread to the readers on one event loop, one callback per burst.

    Each ``call_soon_threadsafe`` writes to the loop's self-pipe: a syscall that also hands the GIL to the loop's
    thread. One per output meant hundreds per step at high concurrency, each a GIL round trip between the step
    thread and the thread streaming the responses. Here the first output of a burst schedules one drain, and the
    outputs that follow before it runs ride along. Waiting readers also wake every ``TICK`` seconds (one timer per
    loop, not one per wait) to look whether the step thread still runs.
    """

    TICK = 0.5
    _by_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopDelivery]" = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending: list[tuple[OutputStream, Any]] = []
        self._lock = threading.Lock()
        self._waiting: set[OutputStream] = set()   # loop thread only
        self._ticking = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "LoopDelivery":
        d = cls._by_loop.get(loop)
        if d is None:
            d = cls._by_loop[loop] = cls(loop)
        return d

    def put(self, stream: "OutputStream", item: Any) -> None:
        """Any thread: deliver ``item`` to ``stream``'s reader."""
        with self._lock:
            first = not self._pending
            self._pending.append((stream, item))
        if first:
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody is left to read
                pass

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for stream, item in batch:
            stream.items.append(item)
            stream.wake()

    async def wait(self, stream: "OutputStream") -> None:
        """Loop thread: until ``stream`` has an item or the next tick."""
        fut = stream.waiter = self.loop.create_future()
        self._waiting.add(stream)
        if not self._ticking:
            self._ticking = True
            self.loop.call_later(self.TICK, self._tick)
        try:
            await fut
        finally:
            stream.waiter = None
            self._waiting.discard(stream)

    def _tick(self) -> None:
        for stream in list(self._waiting):
            stream.wake()
        self._ticking = bool(self._waiting)
        if self._ticking:
            self.loop.call_later(self.TICK, self._tick)


class OutputStream:
    """Thread-safe queue of a request's outputs; delivers to an event loop (``LoopDelivery``) once read
    asynchronously."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._delivery: LoopDelivery | None = None
        self.items: deque = deque()                       # async reader's outputs (loop thread only)
        self.waiter: asyncio.Future | None = None         # the async reader's wait, while it waits

    def put(self, item: Any) -> None:
        with self._lock:
            if self._delivery is not None:
                self._delivery.put(self, item)
            else:
                self._q.put(item)

    def get(self, timeout: float | None = None) -> Any:
        """The next item, or None (immediately when timeout is 0, else after ``timeout`` seconds)."""
        try:
            return self._q.get(block=bool(timeout), timeout=timeout or None)
        except queue.Empty:
            return None

    def wake(self) -> None:
        """Loop thread: end the reader's wait, if it waits."""
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def attach(self, loop: asyncio.AbstractEventLoop) -> LoopDelivery:
        """From now on deliver to ``items`` on ``loop`` (called on the loop's thread)."""
        with self._lock:
            if self._delivery is None:
                self._delivery = LoopDelivery.of(loop)
                while True:
                    try:
                        self.items.append(self._q.get_nowait())
                    except queue.Empty:
                        break
            return self._delivery


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
        engine, stream = self._engine, self._request.stream
        delivery = stream.attach(asyncio.get_running_loop())
        items = stream.items
        while not self._done:
            if items:
                yield self._got(items.popleft())
            elif engine.background:
                await delivery.wait(stream)  # an output, or a tick: look again whether the step thread still runs
            elif getattr(engine, "failure", None):  # the step thread died: take its last outputs, never step here
                await asyncio.sleep(0)  # outputs it queued via call_soon_threadsafe land first
                if not items:
                    raise InferflowError(f"request {self.request_id}: the engine stopped: {engine.failure}")
            else:  # no step thread: run a step off the event loop, then look again
                worked = await asyncio.to_thread(engine.step)
                await asyncio.sleep(0)  # outputs queued via call_soon_threadsafe land first
                if not worked and not engine.has_unfinished() and not items:
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
