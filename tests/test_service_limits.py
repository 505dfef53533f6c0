"""Overload answers with Retry-After: 503 when a model's engine queue is full, 429 when the server's concurrency
limit is reached; closing the streams aborts the requests and frees their KV blocks."""
import time

import httpx
import openai
import pytest

from service_helpers import LiveServer, chat_llama

MSG = [{"role": "user", "content": "hello"}]


def _idle(served, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = served.engine.metrics()
        if m["running"] == m["waiting"] == m["kv_blocks_used"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(served.engine.metrics())


def test_overloaded_503_and_429(tmp_path):
    from inferflow.service import config_from_dict, create_app

    folder = str(chat_llama(tmp_path / "m"))
    long_ctx = {"max_position_embeddings": 16384}  # requests that outlast the checks below (15000 tokens)
    cfg = config_from_dict({"max_concurrent_requests": 3, "retry_after": 2, "models": [
        {"name": "busy", "source": folder, "overrides": long_ctx, "engine": {"max_num_seqs": 1, "max_waiting": 1}},
        {"name": "free", "source": folder, "overrides": long_ctx}]})
    app = create_app(cfg)
    state = app.state.service
    with LiveServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        long = dict(messages=MSG, max_tokens=15000, stream=True, extra_body={"ignore_eos": True})
        a = client.chat.completions.create(model="busy", **long)
        next(iter(a))
        b = client.chat.completions.create(model="busy", **long)   # queued behind a (max_num_seqs 1)
        next(iter(b))
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="busy", messages=MSG, max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "2"
        assert e.value.response.json()["error"]["code"] == "overloaded"
        d = client.chat.completions.create(model="free", **long)   # the third in-flight request
        next(iter(d))
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model="free", messages=MSG, max_tokens=2)
        assert e.value.response.headers["retry-after"] == "2" and "limit 3" in e.value.message
        for s in (a, b, d):
            s.close()
        for name in ("busy", "free"):
            _idle(state.models[name])
            state.models[name].engine.scheduler.pool.assert_clean()
        assert state.slots.used == 0
        # once the streams are gone the server takes requests again
        r = client.chat.completions.create(model="busy", messages=MSG, max_tokens=2)
        assert r.choices[0].message.role == "assistant"
        # a non-streaming client that gives up is noticed too: its request is aborted, its blocks freed
        free = state.models["free"]
        aborted = free.engine.metrics()["requests_aborted"]
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", timeout=httpx.Timeout(5.0, read=0.5), json={
                "model": "free", "prompt": "hello", "max_tokens": 15000, "ignore_eos": True})
        _idle(free)
        assert free.engine.metrics()["requests_aborted"] == aborted + 1 and state.slots.used == 0
