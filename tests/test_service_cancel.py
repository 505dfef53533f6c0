"""Clients that leave mid-request through the real HTTP server: an abrupt close (TCP reset) mid-stream, a close right
after sending, a body cut short, a client-side timeout, garbage sent as a follow-up on a streaming connection.
Each abandoned request is aborted and frees its KV blocks (the pool returns to idle and ``assert_clean`` passes),
and a greedy stream running alongside them produces exactly the text it produces alone."""
import json
import socket
import struct
import threading
import time

import httpx
import pytest

from service_helpers import LiveServer, chat_llama

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from inferflow.service import config_from_dict, create_app

    folder = str(chat_llama(tmp_path_factory.mktemp("cancel") / "m"))
    # op by op: these tests need 3000-token requests that outlast 0.3-0.5 s client timeouts, and the native decode
    # program runs this 64-wide model's steps fast enough to finish first (the cancellation paths are the engine's)
    cfg = config_from_dict({"models": [{"name": "tiny", "source": folder,
                                        "engine": {"num_blocks": 64, "native_decode": False},
                                        "overrides": {"max_position_embeddings": 4096}}]})
    app = create_app(cfg)
    with LiveServer(app) as srv:
        srv.state = app.state.service
        srv.served = srv.state.models["tiny"]
        yield srv


def _request(path, body, *, length=None):
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length if length is not None else len(data)}\r\n\r\n").encode()
    return head + data


def _connect(srv):
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    return s


def _reset(s):
    """Close with an RST instead of a FIN (SO_LINGER 0): the abrupt end of a crashed or killed client."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def _read_until(s, marker, limit=1 << 20):
    buf = b""
    while marker not in buf:
        chunk = s.recv(4096)
        assert chunk and len(buf) < limit, buf[-500:]
        buf += chunk
    return buf


def _wait(served, aborted_at_least, timeout=15.0):
    deadline = time.monotonic() + timeout
    while True:
        m = served.engine.metrics()
        if m["running"] == m["waiting"] == m["kv_blocks_used"] == 0 and m["requests_aborted"] >= aborted_at_least:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


LONG = {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True}


def test_abandoned_requests_free_their_blocks(server, one_thread):
    srv, served = server, server.served
    greedy = {"prompt": PROMPT, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(srv.url + "/v1/completions", json=greedy, timeout=60).json()["choices"][0]["text"]
    aborted0 = served.engine.metrics()["requests_aborted"]
    got = {}

    def survivor():  # a stream that runs while the others are abandoned
        with httpx.stream("POST", srv.url + "/v1/completions", json={**greedy, "stream": True}, timeout=60) as r:
            got["text"] = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                                  if line.startswith("data: {"))

    t = threading.Thread(target=survivor)
    t.start()
    # 1. streaming (chat and completions), then a TCP reset after the first chunk
    for path, body in (("/v1/completions", {**LONG, "stream": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3000,
                                                 "ignore_eos": True, "stream": True})):
        s = _connect(srv)
        s.sendall(_request(path, body))
        _read_until(s, b"data: {")
        # running: a chat stream's first chunk (the role) goes out at admission, its blocks come with the schedule
        deadline = time.monotonic() + 10
        while served.engine.metrics()["kv_blocks_used"] == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        assert served.engine.metrics()["kv_blocks_used"] > 0
        _reset(s)
    # 2. a non-streaming request, then a reset while it runs (no byte of the answer sent yet)
    s = _connect(srv)
    s.sendall(_request("/v1/completions", LONG))
    time.sleep(0.3)
    _reset(s)
    # 3. a streaming request followed by garbage on the same connection, then a plain close
    s = _connect(srv)
    s.sendall(_request("/v1/completions", {**LONG, "stream": True}))
    _read_until(s, b"data: {")
    s.sendall(b"\x00\xffGARBAGE / HTTP/9.9\r\n\r\n{{{")
    time.sleep(0.1)
    s.close()
    # 4. a body cut short: Content-Length promises more than is ever sent
    s = _connect(srv)
    s.sendall(_request("/v1/completions", LONG, length=5000))
    time.sleep(0.2)
    _reset(s)
    # 5. a client that times out waiting for a non-streaming answer
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(10.0, read=0.5))
    t.join(60)
    assert got["text"] == alone  # the survivor was not disturbed
    m = _wait(served, aborted0 + 5)
    served.engine.scheduler.pool.assert_clean()
    assert srv.state.slots.used == 0 and not srv.state.live
    assert m["requests_failed"] == 0
    # and the engine keeps serving
    r = httpx.post(srv.url + "/v1/completions", json=greedy, timeout=60)
    assert r.json()["choices"][0]["text"] == alone


def test_half_closed_stream_is_cancelled(server, one_thread):
    """A client that sends its request and shuts its side down (EOF) has gone: its stream is cancelled."""
    srv, served = server, server.served
    aborted0 = served.engine.metrics()["requests_aborted"]
    s = _connect(srv)
    s.sendall(_request("/v1/completions", {**LONG, "stream": True}))
    _read_until(s, b"data: {")
    s.shutdown(socket.SHUT_WR)
    _wait(served, aborted0 + 1)
    s.close()
    served.engine.scheduler.pool.assert_clean()


def test_many_client_timeouts(server, one_thread):
    """Clients timing out in quick succession: every request is aborted (a cancellation that arrives as an output
    does must not be lost, or the request would run on to its end and hold its slot and blocks meanwhile)."""
    import asyncio

    srv, served = server, server.served
    m0 = served.engine.metrics()

    async def client_loop(client):
        for _ in range(10):
            with pytest.raises(httpx.ReadTimeout):
                await client.post(srv.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.2))

    async def main():
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=6, keepalive_expiry=2.0)) as client:
            await asyncio.gather(*(client_loop(client) for _ in range(6)))

    asyncio.run(main())
    m = _wait(served, m0["requests_aborted"] + 50, timeout=5.0)  # promptly: a missed abort runs thousands of steps
    # (a client may leave before its body is read: then no request is made, hence 50 of 60)
    assert m["requests_finished"] - m0["requests_finished"] == m["requests_aborted"] - m0["requests_aborted"]
    served.engine.scheduler.pool.assert_clean()
    assert srv.state.slots.used == 0 and not srv.state.live
