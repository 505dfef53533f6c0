"""Serving benchmark: streamed requests against an inferflow-service (``/v1/completions``) at a given arrival
rate, with a concurrency cap; per request TTFT, inter-token latencies and end-to-end latency.

TTFT = time to the first streamed text; ITL = gaps between text chunks; TPOT = (latency - TTFT) / (output
tokens - 1); output tokens come from the stream's usage record. Goodput counts the requests per second that meet
every given SLO (``--slo-ttft-ms``, ``--slo-tpot-ms``). Without ``--url`` the benchmark starts the service
in-process on a free port with the model it is given.
"""
from __future__ import annotations

import gc
import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .report import summary


@dataclass(slots=True)
class RequestRecord:
    prompt_tokens: int
    start: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def arrival_gaps(n: int, rate: float, kind: str, seed: int = 0) -> list[float]:
    """Seconds between request starts: Poisson (exponential gaps) or fixed; ``rate`` inf: all at once."""
    if rate == float("inf") or rate <= 0:
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.expovariate(rate) if kind == "poisson" else 1.0 / rate for _ in range(n)]


def one_request(client: Any, url: str, model: str, prompt: list[int], max_tokens: int, headers: dict) -> RequestRecord:
    rec = RequestRecord(len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    rec.start = t0 = time.perf_counter()
    last = None
    try:
        with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                rec.error = f"HTTP {r.status_code}: {r.text[:200]}"
                return rec
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    rec.error = str(ev["error"])[:200]
                    break
                now = time.perf_counter()
                if any(c.get("text") for c in ev.get("choices", [])):
                    if rec.ttft is None:
                        rec.ttft = now - t0
                    else:
                        rec.itl.append(now - last)
                    last = now
                    rec.output_tokens += 1  # replaced by the usage record when the stream sends one
                if ev.get("usage"):
                    rec.output_tokens = int(ev["usage"].get("completion_tokens", rec.output_tokens))
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        rec.error = f"{type(e).__name__}: {e}"
    rec.latency = time.perf_counter() - t0
    return rec


def run_serving(url: str, prompts: list[list[int]], max_tokens: int, *, model: str | None = None, rate: float =
                float("inf"), arrival: str = "poisson", max_concurrency: int | None = None, api_key: str | None =
                None, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None, seed: int = 0,
                warmup: bool = True, warmup_prompts: list[list[int]] | None = None,
                warmup_tokens: int = 16) -> dict[str, Any]:
    """Send every prompt once (arrivals at ``rate`` req/s, at most ``max_concurrency`` in flight); metrics.

    Warm-up, untimed: ``warmup_prompts`` all at once (``warmup_tokens`` new tokens each, enough for a pure-decode
    step of all of them, whose CUDA graph is then captured; prompts of their own, so no prefix-cache hit helps a
    timed request), else with ``warmup`` the first prompt alone for 2 tokens."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    width = max(max_concurrency or len(prompts), len(warmup_prompts or ()), 1)
    # one pooled connection per request in flight: none waits for a connection, none is re-opened
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    with httpx.Client(timeout=httpx.Timeout(600.0), limits=limits) as client:
        if model is None:
            model = client.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
        if warmup_prompts:  # kernels compiled, graphs captured, connections opened: all outside the timing
            with ThreadPoolExecutor(max_workers=len(warmup_prompts)) as pool:
                list(pool.map(lambda p: one_request(client, url, model, p, warmup_tokens, headers),
                              warmup_prompts))
        elif warmup:  # first-request costs (allocator, lazy imports, connection) stay out of the figures
            one_request(client, url, model, prompts[0], 2, headers)
        cap = threading.BoundedSemaphore(max_concurrency or len(prompts))
        gaps = arrival_gaps(len(prompts), rate, arrival, seed)

        def task(p: list[int]) -> RequestRecord:
            try:
                return one_request(client, url, model, p, max_tokens, headers)
            finally:
                cap.release()

        t0 = time.perf_counter()
        futures = []
        with ThreadPoolExecutor(max_workers=max_concurrency or len(prompts)) as pool:
            for gap, p in zip(gaps, prompts):
                time.sleep(gap)
                cap.acquire()
                futures.append(pool.submit(task, p))
            records = [f.result() for f in futures]
        duration = time.perf_counter() - t0
    return aggregate(records, duration, slo_ttft_ms, slo_tpot_ms) | {"model": model, "url": url, "rate": rate,
                                                                     "arrival": arrival,
                                                                     "max_concurrency": max_concurrency}


def aggregate(records: list[RequestRecord], duration: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.ttft is not None]
    ms = lambda xs: {k: 1000 * v for k, v in summary(xs).items()}  # noqa: E731

    def good(r: RequestRecord) -> bool:
        if slo_ttft_ms is not None and r.ttft * 1000 > slo_ttft_ms:
            return False
        return slo_tpot_ms is None or r.tpot is None or r.tpot * 1000 <= slo_tpot_ms

    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5], "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "ttft_ms": ms([r.ttft for r in ok]), "tpot_ms": ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": ms([x for r in ok for x in r.itl]), "e2e_latency_ms": ms([r.latency for r in ok]),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "goodput": sum(good(r) for r in ok) / duration,
        "per_request": [{"ttft_ms": 1000 * r.ttft, "tpot_ms": 1000 * r.tpot if r.tpot is not None else None,
                         "latency_ms": 1000 * r.latency, "output_tokens": r.output_tokens} for r in ok],
        "itl_samples_ms": [1000 * x for r in ok for x in r.itl],
    }


class LocalService:
    """inferflow-service on a free 127.0.0.1 port in this process (uvicorn on a background thread)."""

    def __init__(self, source: str | None, dtype: str | None = None, device: str | None = None,
                 max_num_seqs: int = 64, name: str = "bench", profile: str | None = None, profile_steps: int = 8,
                 engine: dict[str, Any] | None = None):
        """``engine``: more EngineConfig keys (max_num_batched_tokens, gpu_memory_utilization, ...)."""
        from ..service import config_from_dict, create_app, load_models
        from ..service.threaded import ThreadedServer

        model = {"name": name, "engine": {"max_num_seqs": max_num_seqs, **(engine or {})}}
        model.update({k: v for k, v in {"source": source, "dtype": dtype, "device": device}.items() if v})
        cfg = config_from_dict({"models": [model], "log_level": "warning"})
        self.served = load_models(cfg)[name]   # kept: the benchmark reads the model's vocabulary and tokenizer
        if profile:  # a trace of the engine's first steps (as $INFERFLOW_PROFILE_DIR does for any service)
            from ..engine.profiling import StepProfiler

            self.served.engine.profiler = StepProfiler(profile, profile_steps, name="service")
        app = create_app(cfg, {name: self.served})
        if gc.get_freeze_count():  # a console script froze its imports (cli.py): as inferflow-service does, the
            from .. import freeze_heap  # loaded model too, so that the timed run meets the service's collector

            freeze_heap()
        self.http = ThreadedServer(app, start_timeout=120)
        self.url = self.http.url

    def stop(self) -> None:
        self.http.stop()
