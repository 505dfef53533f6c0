"""The OpenAI routes on a real uvicorn server, driven by the official ``openai`` client."""
import base64
import json
import time

import httpx
import numpy as np
import openai
import pytest

from service_helpers import API_KEY, live  # noqa: F401  (the session server fixture)

MSG = [{"role": "user", "content": "hello world"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models(client, live):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "tools", "bytes", "embed"]
    assert client.models.retrieve("tiny").id == "tiny"
    card = httpx.get(live.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"][0]
    assert card["max_model_len"] == 128 and card["object"] == "model"


def test_chat_non_streaming(client, live):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "tiny" and r.created > 0
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str) and c.finish_reason == "length"
    prompt = httpx.post(live.url + "/tokenize", json={"model": "tiny", "messages": MSG},
                        headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert r.usage.prompt_tokens == prompt["count"] and r.usage.completion_tokens == 6
    assert r.usage.total_tokens == prompt["count"] + 6 and r.usage.prompt_tokens_details.cached_tokens >= 0
    # the same greedy request streamed gives the same text
    chunks = list(client.chat.completions.create(model="tiny", messages=MSG, max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert len({ch.id for ch in chunks}) == 1


def test_sse_framing_ends_with_done(live):
    body = {"model": "tiny", "messages": MSG, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", live.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    events = raw.decode().split("\n\n")
    assert events[-2] == "data: [DONE]" and events[-1] == ""
    assert all(e.startswith("data: {") for e in events[:-2])


def test_multi_turn(client, live):
    turns = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi there"},
             {"role": "assistant", "content": "hello!"}, {"role": "user", "content": "the quick brown fox"}]
    r = client.chat.completions.create(model="tiny", messages=turns, max_tokens=3, **GREEDY)
    tok = live.state.models["tiny"].tokenizer
    rendered = tok.apply_chat_template(turns)
    assert rendered.count("<|im_start|>") == 5  # every turn reaches the template, not just the last per role
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_completions_n_and_seed(client):
    kw = dict(model="tiny", prompt="hello world", max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(n=2, seed=7, **kw)
    assert a.object == "text_completion" and [c.index for c in a.choices] == [0, 1]
    assert a.usage.completion_tokens == 16
    b = client.completions.create(n=2, seed=7, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same samples
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert len(others) > 1
    # several prompts: choice i * n + j
    r = client.completions.create(model="tiny", prompt=["hello", "the quick"], n=2, max_tokens=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]


def test_completions_token_prompt_echo_and_stream(client, live):
    ids = live.state.models["tiny"].tokenizer.encode("hello world")
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text.startswith("hello world") and r.usage.prompt_tokens == len(ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=ids, max_tokens=4, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "hello world" + streamed == r.choices[0].text


def test_stop_strings(client):
    full = client.completions.create(model="tiny", prompt="hello", max_tokens=20, **GREEDY).choices[0].text
    stop = full[6:9]
    cut = full[:full.find(stop)]
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=20, stop=[stop, "never-there"], **GREEDY)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model="tiny", prompt="hello", max_tokens=20, stop=stop, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks) == cut


def test_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4, logprobs=True, top_logprobs=3,
                                       **GREEDY)
    content = r.choices[0].logprobs.content
    # special tokens (skipped in the text) still appear as tokens, as in vLLM
    assert len(content) == 4 and "".join(t.token for t in content).replace("<s>", "") == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.logprob == pytest.approx(max(x.logprob for x in t.top_logprobs))  # greedy: the top token
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    c = client.completions.create(model="tiny", prompt="hello", max_tokens=3, logprobs=2, **GREEDY).choices[0]
    assert len(c.logprobs.tokens) == 3 and all(len(t) == 2 for t in c.logprobs.top_logprobs)
    assert c.logprobs.text_offset[0] == 0


def test_tool_call(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    msgs = [{"role": "user", "content": "What weather Paris?"}]
    r = client.chat.completions.create(model="tools", messages=msgs, tools=tools, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(client.chat.completions.create(model="tools", messages=msgs, tools=tools, temperature=0,
                                                 stream=True))
    deltas = [ch.choices[0].delta for ch in chunks]
    assert "".join(d.content or "" for d in deltas) == ""  # the call is not leaked as text
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # without tools the same output is plain content; the assistant's call and the tool's answer go back in
    plain = client.chat.completions.create(model="tools", messages=msgs, temperature=0).choices[0]
    assert plain.finish_reason == "stop" and plain.message.content.startswith("<tool_call>")
    follow = msgs + [c.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    client.chat.completions.create(model="tools", messages=follow, tools=tools, temperature=0, max_tokens=2)


def test_embeddings(client, live):
    texts = ["hello world", "the cat sat on the mat"]
    r = client.embeddings.create(model="embed", input=texts)
    assert [d.index for d in r.data] == [0, 1] and len(r.data[0].embedding) == 32
    want = live.state.models["embed"].model.embed(texts)
    for d, w in zip(r.data, want):
        assert d.embedding == pytest.approx(w.tolist(), abs=1e-5)
    assert r.usage.prompt_tokens == sum(len(live.state.models["embed"].tokenizer.encode(t)) for t in texts)
    b64 = client.embeddings.create(model="embed", input="hello world", encoding_format="base64")
    vec = np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4")
    assert vec.tolist() == pytest.approx(want[0].tolist(), abs=1e-5)


def _error(exc_info) -> dict:
    return exc_info.value.response.json()["error"]


def test_errors_400_named_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, temperature=-1)
    assert _error(e)["param"] == "temperature" and "temperature" in _error(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])
    assert _error(e)["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, top_logprobs=2)
    assert _error(e)["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input="x")
    assert _error(e)["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", n=9)
    assert _error(e)["param"] == "n" and "max_num_seqs (8)" in _error(e)["message"]


def test_prefix_cache_hits_show_in_usage(client):
    turns = [{"role": "system", "content": "be nice and brief, this is a tiny test"},
             {"role": "user", "content": "hello world, the quick brown fox jumps over the lazy dog!"}]
    first = client.chat.completions.create(model="tiny", messages=turns, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model="tiny", messages=turns, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 32
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # whole 16-token blocks from the prefix cache


def test_error_400_prompt_longer_than_context(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hello world " * 80, max_tokens=10)
    msg = _error(e)["message"]
    n = int(msg.split("(")[1].split(" in the prompt")[0])
    assert n > 128 and "maximum context length is 128 tokens" in msg and f"{n + 10} tokens" in msg
    with pytest.raises(openai.BadRequestError) as e:  # fits alone, not with the completion asked for
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=200)
    assert "maximum context length is 128 tokens" in _error(e)["message"] and "200 in the completion" in \
        _error(e)["message"]


def test_error_401_404_413(live, client):
    bad = openai.OpenAI(base_url=live.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="tiny", messages=MSG)
    assert _error(e)["type"] == "authentication_error"
    assert httpx.get(live.url + "/v1/models").status_code == 401
    assert httpx.get(live.url + "/health").status_code == 200  # health and metrics stay open
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=MSG)
    assert _error(e)["param"] == "model" and "tiny" in _error(e)["message"]
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * 70000}])
    assert e.value.status_code == 413 and "65536" in _error(e)["message"]
    r = httpx.get(live.url + "/nowhere")
    assert r.status_code == 404 and "error" in r.json()


def test_cors_metrics_openapi(live, client):
    pre = httpx.options(live.url + "/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
    assert pre.headers["access-control-allow-origin"] == "http://app.example"
    client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    for route in ("/metrics", "/openapi.json", "/version"):  # only /health is open when api_keys is set
        assert httpx.get(live.url + route).status_code == 401, route
    text = httpx.get(live.url + "/metrics", headers=auth).text
    assert 'inferflow_http_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert 'inferflow_http_requests_total{route="/v1/chat/completions",status="400"}' in text
    assert 'inferflow_http_requests_total{route="other",status="404"}' in text  # /nowhere
    for name in ("time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
                 "engine_waiting", "engine_kv_blocks_used", "engine_prefix_cache_hit_rate", "generation_tokens_total"):
        assert f"inferflow_{name}" in text, name
    doc = httpx.get(live.url + "/openapi.json", headers=auth).json()
    assert doc["openapi"].startswith("3.") and "/v1/chat/completions" in doc["paths"] and "/" in doc["paths"]
    d = httpx.post(live.url + "/detokenize", json={"model": "tiny", "tokens": [5, 6]},
                   headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert isinstance(d["prompt"], str)


def _engine_idle(served, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = served.engine.metrics()
        if m["running"] == 0 and m["waiting"] == 0 and m["kv_blocks_used"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"engine still busy: {served.engine.metrics()}")


def test_disconnect_frees_kv_blocks(live):
    served = live.state.models["tiny"]
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: {"):
            pass
        assert served.engine.metrics()["kv_blocks_used"] > 0
    m = _engine_idle(served)  # leaving the block closed the connection: the request was aborted
    assert m["requests_aborted"] >= 1
    served.engine.scheduler.pool.assert_clean()

