"""Request limits and access: body size (413), prompt vs context (400 with both numbers), max_tokens / n / stop caps
(400 naming the field), API keys on every route but /health (401, OpenAI's error shape); and, on a real
``python -m inferflow.service`` process: keys from ``--api-key`` and $INFERFLOW_API_KEY, the default bind to
127.0.0.1, and a graceful SIGTERM (in-flight streams end properly, exit status 0)."""
import json
import re
import signal
import threading
from pathlib import Path

import httpx
import pytest

from service_helpers import LiveServer, chat_llama
from tools.service_process import ServiceProcess

KEY = "sk-access"
AUTH = {"Authorization": f"Bearer {KEY}"}
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return chat_llama(tmp_path_factory.mktemp("access") / "tiny")


@pytest.fixture(scope="module")
def srv(folder):
    from inferflow.service import config_from_dict, create_app

    cfg = config_from_dict({"api_keys": [KEY], "max_body_bytes": 4096, "max_tokens_limit": 8, "max_n": 2,
                            "max_stop": 2, "models": [{"name": "tiny", "source": str(folder)}]})
    with LiveServer(create_app(cfg)) as s:
        yield s


def _post(srv, path, body, headers=AUTH, **kw):
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=60, **kw)


def _error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return err["message"]


ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings"),
          ("GET", "/v1/models"), ("GET", "/v1/models/tiny"), ("POST", "/tokenize"), ("POST", "/detokenize"),
          ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/version")]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-wrong"}])
def test_every_route_but_health_needs_a_key(srv, headers):
    for method, path in ROUTES:
        body = {"model": "tiny"} if method == "POST" else None
        r = httpx.request(method, srv.url + path, headers=headers, json=body)
        assert r.status_code == 401, (path, r.status_code)
        err = r.json()["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key" and "API key" in err["message"]
    r = httpx.post(srv.url + "/", headers=headers, json={"text": "hello"})
    assert r.status_code == 401 and r.json()["ret_code"] == "error.unauthorized"
    assert httpx.get(srv.url + "/health", headers=headers).status_code == 200
    assert httpx.get(srv.url + "/version", headers={"x-api-key": KEY}).status_code == 200


def test_caps_on_max_tokens_n_and_stop(srv):
    msg = _error(_post(srv, "/v1/completions", {"prompt": "hello", "max_tokens": 9}), 400, "max_tokens")
    assert "9" in msg and "maximum of 8" in msg
    _error(_post(srv, "/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 9}), 400,
           "max_completion_tokens")
    r = _post(srv, "/v1/chat/completions", {"messages": MSG, "ignore_eos": True})  # no max_tokens: the cap
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert "maximum of 2" in _error(_post(srv, "/v1/completions", {"prompt": "hello", "n": 3}), 400, "n")
    stops = _post(srv, "/v1/completions", {"prompt": "hello", "stop": ["a", "b", "c"]})
    assert "3 stop strings" in _error(stops, 400, "stop")
    assert _post(srv, "/v1/completions", {"prompt": "hello", "stop": ["a", "b"], "max_tokens": 2}).status_code == 200
    native = _post(srv, "/", {"text": "hello", "max_new_tokens": 100, "is_streaming_mode": False})
    assert native.status_code == 200 and native.json()["finish_reason"] in ("length", "stop")


def test_body_size_and_context(srv):
    big = {"prompt": "x" * 5000}
    assert "4096" in _error(_post(srv, "/v1/completions", big), 413)
    chunked = httpx.post(srv.url + "/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                         content=iter([json.dumps(big).encode()]))  # no Content-Length: counted while read
    assert "4096" in _error(chunked, 413)
    msg = _error(_post(srv, "/v1/completions", {"prompt": [5] * 130, "max_tokens": 4}), 400, "prompt")
    assert "maximum context length is 128 tokens" in msg and "134 tokens" in msg and "130 in the prompt" in msg


def _listen_address(port):
    """The address a LISTEN socket on ``port`` is bound to, from /proc/net/tcp (None: not found)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":
                return addr
    return None


def test_process_keys_bind_and_graceful_sigterm(folder, tmp_path):
    # the long stream must outlive the 1.5 s grace: 15000 tokens (a decode step of this model is ~0.2 ms natively)
    config = {"shutdown_grace": 1.5, "models": [{"name": "tiny", "source": str(folder),
                                                 "overrides": {"max_position_embeddings": 16384}}]}
    svc = ServiceProcess(config, args=["--api-key", "sk-cli"], env={"INFERFLOW_API_KEY": "sk-env"})
    try:
        if Path("/proc/net/tcp").exists():
            assert _listen_address(svc.port) == "0100007F"  # 127.0.0.1: not reachable from other hosts
        for key in ("sk-cli", "sk-env"):
            assert httpx.get(svc.url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert httpx.get(svc.url + "/v1/models").status_code == 401
        events = {"long": [], "short": []}
        started = {name: threading.Event() for name in events}

        def stream(name, max_tokens):
            body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", svc.url + "/v1/completions", json=body, timeout=60,
                              headers={"Authorization": "Bearer sk-cli"}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events[name].append(line[6:])
                        started[name].set()

        threads = [threading.Thread(target=stream, args=("long", 15000)), threading.Thread(target=stream,
                                                                                           args=("short", 40))]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started.values())
        svc.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        status = svc.proc.wait(60)
    finally:
        status = svc.stop()
    out = svc.output()
    assert status == 0, out
    assert "serving tiny on http://127.0.0.1:" in out
    finishes = {}
    for name, ev in events.items():  # both streams were terminated properly: a finish_reason, then [DONE]
        assert ev[-1] == "[DONE]", (name, ev[-3:])
        finishes[name] = [c["finish_reason"] for e in ev[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
    assert finishes["long"] == ["abort"]  # it outlived the grace period
    assert finishes["short"] in (["length"], ["abort"])  # "length" unless the machine is very slow
    # (the short stream may have ended before the signal arrived)
    assert re.search(r"draining [12] in-flight request\(s\)", out) and "cancelled 1 request(s)" in out, out


@pytest.mark.parametrize("key, value", [("max_tokens_limit", 0), ("max_n", -1), ("max_stop", "4"),
                                        ("shutdown_grace", -1), ("shutdown_grace", "soon")])
def test_limit_keys_are_validated(key, value):
    from inferflow.service import config_from_dict
    from inferflow.service.config import ServiceConfigError

    with pytest.raises(ServiceConfigError) as e:
        config_from_dict({key: value}, "svc.yaml")
    assert str(e.value).startswith(f"svc.yaml: {key}:")
    cfg = config_from_dict({"max_tokens_limit": 64, "max_n": 4, "max_stop": 2, "shutdown_grace": 2.5})
    assert (cfg.max_tokens_limit, cfg.max_n, cfg.max_stop, cfg.shutdown_grace) == (64, 4, 2, 2.5)
