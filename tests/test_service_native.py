"""Inferflow's native route (POST /) on a real server, through httpx."""
import json

import httpx
import pytest

from inferflow.service.decoding_alg import STRATEGIES
from inferflow.service.native_routes import native_params, native_prompt
from service_helpers import API_KEY, UTF8_TEXT, live  # noqa: F401

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(live, body, **kw):
    return httpx.post(live.url + "/", json=body, headers=AUTH, timeout=60, **kw)


def _stream_lines(live, body) -> list[bytes]:
    with httpx.stream("POST", live.url + "/", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        raw = b"".join(r.iter_raw())
    assert raw.endswith(b"\n")
    return raw.split(b"\n")[:-1]


def test_non_streaming_and_streaming_agree(live):
    body = {"text": "hello world", "decoding_alg": "greedy", "max_new_tokens": 6, "model": "tiny"}
    r = _post(live, {**body, "is_streaming_mode": False}).json()
    assert r["ret_code"] == "succ" and r["error_text"] == "" and r["is_end"] == 1 and r["time_cost"] > 0
    chunks = [json.loads(line) for line in _stream_lines(live, body)]  # is_streaming_mode defaults to true
    assert [c["is_end"] for c in chunks] == [0] * (len(chunks) - 1) + [1]
    assert all(c["ret_code"] == "succ" for c in chunks)
    assert "".join(c["text"] for c in chunks) == r["text"]
    assert chunks[-1]["time_cost"] >= chunks[0]["time_cost"]


@pytest.mark.parametrize("alg", sorted(STRATEGIES) + ["sample.top_p", "sample.std", "sample.greedy",
                                                       '{"name": "sample.top_p", "top_p": 0.5, "max_k": 4}'])
def test_each_decoding_alg(live, alg):
    body = {"text": "hello", "decoding_alg": alg, "random_seed": 3, "temperature": 0.8, "max_new_tokens": 4,
            "is_streaming_mode": 0, "model": "tiny"}
    first = _post(live, body).json()
    assert first["ret_code"] == "succ", first
    assert _post(live, body).json()["text"] == first["text"]  # seeded: reproducible


def test_decoding_alg_reaches_sampling_params(live):
    served = live.state.models["tiny"]
    p = native_params(served, {"decoding_alg": "sample.min_p", "temperature": 0.5, "random_seed": 9,
                               "max_output_len": 7}, 5)
    assert (p.min_p, p.top_k, p.temperature, p.seed, p.max_tokens) == (0.05, 50, 0.5, 9, 7)
    p = native_params(served, {"decoding_alg": "fsd"}, 120)
    assert (p.fsd_alpha, p.fsd_k, p.fsd_n, p.fsd_beta, p.seed, p.max_tokens) == (0.5, 6, 3, 0.9, None, 8)
    assert native_params(served, {"decoding_alg": "mirostat"}, 5).mirostat == 2
    assert native_params(served, {"decoding_alg": "greedy", "temperature": 0.9}, 5).greedy


def test_prompt_building(live):
    served = live.state.models["tiny"]
    tok = served.tokenizer
    ids, enc = native_prompt(served, {"text": "hi", "system_prompt": "be nice", "res_prefix": "hello"})
    want = tok.apply_chat_template([{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}])
    assert enc is None and ids == tok.encode(want + "hello", add_special_tokens=False)
    ids, _ = native_prompt(served, {"text": "hi there", "decoder_input_template": "{bos}user: {query}{\\n}{res_prefix}x",
                                    "res_prefix": "assistant:"})
    assert ids == [0] + tok.encode("user: hi there\n", add_special_tokens=False) + \
        tok.encode("assistant:", add_special_tokens=False)


def test_multibyte_utf8_streamed_unbroken(live):
    body = {"text": "hi", "model": "bytes", "decoding_alg": "greedy", "max_new_tokens": 20}
    lines = _stream_lines(live, body)
    texts = [json.loads(line.decode("utf-8", errors="strict"))["text"] for line in lines]
    assert "".join(texts) == UTF8_TEXT and not any("\ufffd" in t for t in texts)
    assert len([t for t in texts if t]) >= 2  # really streamed, one whole character at a time
    assert _post(live, {**body, "is_streaming_mode": False}).json()["text"] == UTF8_TEXT


def test_native_errors(live):
    r = _post(live, {"text": "hello", "decoding_alg": "beam_search", "model": "tiny"})
    assert r.status_code == 400 and r.json()["ret_code"] == "error.invalid_request_format"
    assert "beam_search" in r.json()["error_text"]
    r = _post(live, {"text": "", "model": "tiny"})
    assert r.status_code == 400 and r.json()["ret_code"] == "error.empty_request"
    r = _post(live, {"text": "hello world " * 80, "model": "tiny"})
    err = r.json()
    assert r.status_code == 400 and err["ret_code"] == "error.too_long_request" and "128 tokens" in err["error_text"]
    r = httpx.post(live.url + "/", json={"text": "hello"})
    assert r.status_code == 401 and r.json()["ret_code"] == "error.unauthorized"
    ok = httpx.post(live.url + "/", json={"text": "hello", "is_streaming_mode": False, "max_new_tokens": 2,
                                          "model": "tiny", "header": {"passcode": API_KEY}})
    assert ok.status_code == 200 and ok.json()["ret_code"] == "succ"  # Inferflow clients send the key here
    stat = _post(live, {"header": {"fn": "get_stat"}, "model": "tiny"}).json()
    assert stat["ret_code"] == "succ" and "kv_blocks_used" in stat["stat"]
