"""Outputs from the step thread to async readers (inferflow/engine/handle.py): every output arrives, in order, with
one loop callback per burst of outputs rather than one per output; a waiting reader notices a stopped step thread
within a tick; a reader cancelled mid-wait loses nothing."""
import asyncio
import threading
import time

import pytest

from inferflow.engine.handle import LoopDelivery, OutputStream, RequestHandle


class Out:
    def __init__(self, i: int, finished: bool = False):
        self.i, self.finished = i, finished


class FakeEngine:
    """What a handle reads of an engine: ``background`` while a step thread runs, ``failure`` once it died."""

    def __init__(self):
        self.background, self.failure = True, None


class Req:
    def __init__(self):
        self.request_id, self.stream = "r", OutputStream()


def test_bursts_arrive_in_order_with_one_callback_each(monkeypatch):
    streams = [Req() for _ in range(64)]
    engine = FakeEngine()
    bursts = 20

    async def main():
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe
        monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a: calls.append(1) or real(*a))

        async def read(req):
            return [o.i async for o in RequestHandle(engine, req)]

        tasks = [asyncio.ensure_future(read(r)) for r in streams]
        await asyncio.sleep(0)  # every reader attached and waiting

        def step_thread():
            for b in range(bursts):
                for r in streams:
                    r.stream.put(Out(b, finished=b == bursts - 1))
                time.sleep(0.01)  # the next step

        t = threading.Thread(target=step_thread)
        t.start()
        got = await asyncio.gather(*tasks)
        t.join()
        return got, len(calls)

    got, callbacks = asyncio.run(main())
    assert got == [list(range(bursts))] * len(streams)
    assert callbacks <= 2 * bursts  # one per burst (a drain can split a burst it overtook), not 64 per burst


def test_outputs_put_before_the_reader_attached_come_first():
    req, engine = Req(), FakeEngine()
    req.stream.put(Out(0))
    req.stream.put(Out(1))

    async def main():
        reader = RequestHandle(engine, req)
        it = reader.__aiter__()
        first = [(await it.__anext__()).i, (await it.__anext__()).i]
        threading.Thread(target=lambda: req.stream.put(Out(2, finished=True))).start()
        return first + [o.i async for o in it]

    assert asyncio.run(main()) == [0, 1, 2]


def test_a_waiting_reader_notices_the_step_thread_died(monkeypatch):
    monkeypatch.setattr(LoopDelivery, "TICK", 0.05)
    req, engine = Req(), FakeEngine()

    async def main():
        async def read():
            return [o.i async for o in RequestHandle(engine, req)]

        task = asyncio.ensure_future(read())
        await asyncio.sleep(0.1)
        engine.background, engine.failure = False, "RuntimeError: boom"  # died without a final output
        t0 = time.perf_counter()
        with pytest.raises(Exception, match="engine stopped: RuntimeError: boom"):
            await task
        return time.perf_counter() - t0

    assert asyncio.run(main()) < 1.0


def test_a_reader_cancelled_mid_wait_loses_nothing():
    req, engine = Req(), FakeEngine()

    async def main():
        async def read(n):
            out = []
            async for o in RequestHandle(engine, req):
                out.append(o.i)
                if len(out) == n:
                    break
            return out

        task = asyncio.ensure_future(read(5))
        await asyncio.sleep(0.01)
        task.cancel()  # while it waits
        with pytest.raises(asyncio.CancelledError):
            await task
        threading.Thread(target=lambda: [req.stream.put(Out(i, finished=i == 2)) for i in range(3)]).start()
        return await read(5)

    assert asyncio.run(main()) == [0, 1, 2]
