"""One engine request as a route sees it: async deltas, timing for metrics, and cancellation.

A generation is cancelled (its KV blocks freed) whenever its consumer stops early: the client disconnected
mid-stream (starlette cancels the streaming task), a non-streaming client went away (``until_disconnect``), or
the route failed. Concurrency beyond ``max_concurrent_requests`` is refused with 429 before anything is queued.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from .errors import APIError, overloaded


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


class Slots:
    """Counts in-flight generations against ``max_concurrent_requests`` (None: unlimited)."""

    def __init__(self, limit: int | None, retry_after: float, metrics: Any):
        self.limit, self.retry_after, self.metrics, self.used = limit, retry_after, metrics, 0

    def acquire(self) -> None:
        if self.limit is not None and self.used >= self.limit:
            raise overloaded(f"Too many concurrent requests (limit {self.limit}); retry later", 429, self.retry_after)
        self.used += 1
        self.metrics.in_flight = self.used

    def release(self) -> None:
        self.used -= 1
        self.metrics.in_flight = self.used


class Generation:
    """Submit on creation; iterate ``deltas()`` once; ``final`` holds the last RequestOutput."""

    def __init__(self, state: Any, served: Any, prompt: list[int], params: Any, **submit_kw: Any):
        self.state, self.served, self.prompt, self.params = state, served, prompt, params
        state.slots.acquire()
        try:
            self.handle = served.submit(prompt, params, retry_after=state.config.retry_after, **submit_kw)
        except BaseException:
            state.slots.release()
            raise
        self.t0 = time.perf_counter()
        self.ttft: float | None = None
        self.final: Any = None
        self._closed = False
        state.live.add(self)

    async def deltas(self) -> AsyncIterator[Any]:
        try:
            async for out in _aiter(self.handle):
                if self.ttft is None and any(o.delta_token_ids or o.token_ids for o in out.outputs):
                    self.ttft = time.perf_counter() - self.t0
                self.final = out
                yield out
                if out.finished:
                    break
            if self.final is not None and getattr(self.final, "error", None):
                # an engine fault (a failed forward pass, a dead step thread) fails the request even when it had
                # produced tokens: a 500, or an error event after the stream's last chunk
                raise APIError(500, f"generation failed: {self.final.error}", code="engine_error")
        finally:
            self.close()

    def close(self) -> None:
        """Cancel unless finished (frees the request's KV blocks), record metrics, release the slot. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.state.live.discard(self)
        if self.final is None or not self.final.finished:
            try:
                self.handle.cancel()
            except Exception:
                pass
        self.state.slots.release()
        outs = self.final.outputs if self.final is not None else []
        reasons = [o.finish_reason if self.final is not None and self.final.finished else "abort" for o in outs]
        self.state.metrics.generation_done(self.served.name, len(self.prompt), sum(len(o.token_ids) for o in outs),
                                           self.ttft, time.perf_counter() - self.t0, reasons or ["abort"],
                                           max((len(o.token_ids) for o in outs), default=0))

    async def result(self, request: Any = None) -> Any:
        """The final RequestOutput; with ``request``, a client disconnect cancels the generation (ClientGone)."""

        async def run() -> Any:
            async for _ in self.deltas():
                pass
            return self.final

        if request is None:
            return await run()
        return await until_disconnect(request, run(), on_gone=self.close)


async def _aiter(handle: Any) -> AsyncIterator[Any]:
    """The handle's async iterator, or its blocking iterator driven from a worker thread."""
    if hasattr(handle, "__aiter__"):
        async for out in handle:
            yield out
        return
    it = iter(handle)
    done = object()
    while True:
        out = await asyncio.to_thread(next, it, done)
        if out is done:
            return
        yield out


async def until_disconnect(request: Any, coro: Any, on_gone: Any = None) -> Any:
    """Run ``coro`` unless the client disconnects first (then cancel it and raise ClientGone).

    ``on_gone`` (cancelling the generations ``coro`` waits for) runs first, so the engine stops even if the
    task's cancellation is lost, and waiting for the task is then bounded by the engine's final output."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    if on_gone is not None:
        on_gone()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientGone()
