"""Engine faults behind the real HTTP server: an exception in a forward pass fails the requests of that batch with a
clear error (a 500, or an error event before ``[DONE]``), frees their KV blocks, and the engine keeps serving
(``/health`` stays 200); a dead step thread is reported by ``/health`` (503 with the reason), in-flight requests
end with an error, new ones are refused with 503, and no block stays referenced."""
import json
import threading
import time

import httpx
import pytest

from service_helpers import LiveServer, chat_llama

PROMPT = [5, 6, 7, 8]
POISON = 99  # a prompt containing this token id fails its forward pass once it has generated two tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(chat_llama(tmp_path_factory.mktemp("faults") / "m"))


def _server(folder):
    from inferflow.service import config_from_dict, create_app

    cfg = config_from_dict({"models": [{"name": "tiny", "source": folder,
                                        "overrides": {"max_position_embeddings": 1024}}]})
    app = create_app(cfg)
    return app, app.state.service.models["tiny"]


def _idle(served, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        m = served.engine.metrics()
        if m["running"] == m["waiting"] == m["kv_blocks_used"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.05)


def _events(url, body):
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def _greedy(url, prompt, n):
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                  "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_forward_fault_fails_its_requests_and_the_engine_recovers(folder, one_thread):
    app, served = _server(folder)
    with LiveServer(app) as srv:
        before = _greedy(srv.url, PROMPT, 8)
        real = served.engine.runner.forward

        def faulty(items):
            if any(POISON in seq.request.prompt_ids and len(seq.output_ids) >= 2 for seq, *_ in items):
                raise RuntimeError("injected fault")
            return real(items)

        served.engine.runner.forward = faulty
        # non-streaming: 500 naming the fault
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT + [POISON], "max_tokens": 20,
                                                          "ignore_eos": True}, timeout=60)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "engine_error"
        # streaming: the tokens made before the fault, then an error event, then [DONE]
        events = _events(srv.url, {"prompt": PROMPT + [POISON], "max_tokens": 20, "ignore_eos": True})
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert "injected fault" in err["message"] and err["type"] == "internal_server_error"
        assert [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-2]][-1] == "error"
        # a healthy request alongside a faulty one completes
        results = {}

        def healthy():
            results["events"] = _events(srv.url, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                  "ignore_eos": True})

        t = threading.Thread(target=healthy)
        t.start()
        _events(srv.url, {"prompt": PROMPT + [POISON], "max_tokens": 20, "ignore_eos": True})
        t.join(60)
        ev = results["events"]  # the failed batch is retried sequence by sequence: only the culprit fails
        assert ev[-1] == "[DONE]" and "".join(json.loads(e)["choices"][0]["text"] for e in ev[:-1]) == before
        # the pool is clean, the engine thread lives, /health says so, and greedy output is unchanged
        m = _idle(served)
        served.engine.scheduler.pool.assert_clean()
        assert m["requests_failed"] >= 3 and served.engine.background
        assert httpx.get(srv.url + "/health").status_code == 200
        served.engine.runner.forward = real
        assert _greedy(srv.url, PROMPT, 8) == before
        assert app.state.service.slots.used == 0 and not app.state.service.live


class EngineKilled(BaseException):
    """Not an Exception: nothing in the step loop catches it, so the step thread dies."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_dead_engine_thread_is_reported(folder, one_thread):
    app, served = _server(folder)
    with LiveServer(app) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        real = served.engine.step
        armed = threading.Event()

        def dying_step():
            if armed.is_set():
                raise EngineKilled("simulated crash of the step thread")
            return real()

        served.engine.step = dying_step
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            assert json.loads(first[6:])["choices"]
            armed.set()  # the next step kills the thread
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]"
        assert "engine thread stopped: EngineKilled: simulated crash" in json.loads(rest[-2])["error"]["message"]
        h = httpx.get(srv.url + "/health")
        assert h.status_code == 503 and "EngineKilled" in h.json()["models"]["tiny"] and h.json()["status"] == "failed"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", r.text
        assert served.engine.metrics()["kv_blocks_used"] == 0
        served.engine.scheduler.pool.assert_clean()
        assert app.state.service.slots.used == 0
        served.engine.step = real


def test_failed_batch_fails_only_its_culprit(folder, one_thread):
    """Engine level, deterministic: a healthy request batched with a poisoned one keeps its exact greedy output."""
    import inferflow
    from inferflow.engine.engine import Engine
    from inferflow.engine.sampling_params import SamplingParams

    engine = Engine(inferflow.load(folder))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = engine.generate([PROMPT, [9, 10, 11]], greedy)
    real, batches = engine.runner.forward, []

    def faulty(items):
        batches.append(len(items))
        if any(POISON in seq.request.prompt_ids and len(seq.output_ids) >= 2 for seq, *_ in items):
            raise RuntimeError("injected fault")
        return real(items)

    engine.runner.forward = faulty
    handles = [engine.add_request(PROMPT, greedy), engine.add_request(PROMPT + [POISON], greedy),
               engine.add_request([9, 10, 11], greedy)]
    outs = [h.result() for h in handles]
    assert max(batches) == 3  # they did run together
    assert outs[1].error and "injected fault" in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2])] == [r.outputs[0].token_ids for r in ref]
    assert outs[0].error is None and outs[2].error is None
    engine.scheduler.pool.assert_clean()
