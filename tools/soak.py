"""Soak test of an inferflow service: mixed traffic for a set time, then resident-memory growth and KV pool state.

    python tools/soak.py --config service.yaml [--duration 600]     # starts inferflow-service itself
    python tools/soak.py --url http://127.0.0.1:8080 --pid PID      # a running service (PID: for its RSS)
        [--clients 8] [--warmup 0.3] [--model NAME] [--api-key KEY] [--json out.json]

Each client loops over a weighted mix: chat and completions, streamed and not; streams the client abandons
after the first chunk; requests the client times out on; bad requests (an invalid field, malformed JSON, a prompt
longer than the context; each must get 400); embeddings when a served model is encoder-only. Every answer is
checked against what its kind expects (overload, 429/503 with Retry-After, is accepted anywhere). RSS is sampled
twice a second; the growth is measured from the end of the warm-up (``--warmup``, a fraction of the duration)
to the end, once the service is idle. At the end the engines must be idle with no KV block referenced.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.service_process import ServiceProcess, rss_bytes, wait_idle  # noqa: E402

MIB = 1 << 20
# kind -> weight
MIX = {"chat": 3, "chat_stream": 3, "completion": 3, "completion_stream": 3, "cancel_stream": 2, "timeout": 1,
       "bad_field": 1, "bad_json": 1, "too_long": 1, "embeddings": 2}
MSGS = [[{"role": "user", "content": "hello world"}], [{"role": "system", "content": "be brief"},
                                                       {"role": "user", "content": "the quick brown fox"}]]


class Soak:
    def __init__(self, url: str, api_key: str | None, model: str, max_len: int, embed: str | None, seed: int = 0):
        self.url, self.model, self.max_len, self.embed = url, model, max_len, embed
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.counts: Counter = Counter()
        self.problems: list[str] = []
        self.rng = random.Random(seed)
        kinds = [k for k in MIX if k != "embeddings" or embed]
        self.kinds, self.weights = kinds, [MIX[k] for k in kinds]

    def _check(self, kind: str, r: httpx.Response, want: int) -> None:
        self.counts[f"{kind} {r.status_code}"] += 1
        if r.status_code in (429, 503) and r.headers.get("retry-after"):
            return  # overload is a designed answer
        if r.status_code != want:
            self.problems.append(f"{kind}: status {r.status_code} (want {want}): {r.text[:200]}")

    async def one(self, client: httpx.AsyncClient) -> None:
        kind = self.rng.choices(self.kinds, self.weights)[0]
        n = self.rng.randint(1, 12)
        chat = {"model": self.model, "messages": self.rng.choice(MSGS), "max_tokens": n}
        comp = {"model": self.model, "prompt": "hello world " * self.rng.randint(1, 4), "max_tokens": n}
        long = {"model": self.model, "prompt": "hello", "max_tokens": max(1, min(2000, self.max_len - 16)),
                "ignore_eos": True}
        if kind in ("chat", "completion"):
            path, body = ("/v1/chat/completions", chat) if kind == "chat" else ("/v1/completions", comp)
            r = await client.post(self.url + path, json=body)
            self._check(kind, r, 200)
            if r.status_code == 200 and not r.json().get("choices"):
                self.problems.append(f"{kind}: no choices: {r.text[:200]}")
        elif kind in ("chat_stream", "completion_stream"):
            path, body = ("/v1/chat/completions", chat) if kind == "chat_stream" else ("/v1/completions", comp)
            async with client.stream("POST", self.url + path, json={**body, "stream": True}) as r:
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                if r.status_code == 200 and (not lines or lines[-1] != "data: [DONE]"
                                             or any('"error"' in line for line in lines)):
                    self.problems.append(f"{kind}: stream not ended properly: {lines[-2:]}")
            self._check(kind, r, 200)
        elif kind == "cancel_stream":
            async with client.stream("POST", self.url + "/v1/completions", json={**long, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # leaving the block closes the connection mid-stream
            self._check(kind, r, 200)
        elif kind == "timeout":
            try:
                r = await client.post(self.url + "/v1/completions", json=long, timeout=httpx.Timeout(30, read=0.2))
                self._check(kind, r, 200)
            except httpx.ReadTimeout:
                self.counts["timeout client-timeout"] += 1
        elif kind == "bad_field":
            self._check(kind, await client.post(self.url + "/v1/chat/completions", json={**chat, "temperature": -1}),
                        400)
        elif kind == "bad_json":
            r = await client.post(self.url + "/v1/completions", content=b'{"prompt": "hel',
                                  headers={"Content-Type": "application/json"})
            self._check(kind, r, 400)
        elif kind == "too_long":
            self._check(kind, await client.post(self.url + "/v1/completions", json={
                "model": self.model, "prompt": [5] * (self.max_len + 1), "max_tokens": 1}), 400)
        elif kind == "embeddings":
            r = await client.post(self.url + "/v1/embeddings", json={"model": self.embed, "input": ["hello world",
                                                                                                   "the cat"]})
            self._check(kind, r, 200)

    async def run(self, duration: float, clients: int, on_tick: Any = None) -> None:
        end = time.monotonic() + duration
        limits = httpx.Limits(max_connections=clients, keepalive_expiry=2.0)

        async def client_loop(client: httpx.AsyncClient) -> None:
            while time.monotonic() < end:
                try:
                    await self.one(client)
                except httpx.HTTPError as e:
                    self.problems.append(f"transport: {type(e).__name__}: {e}")

        async def ticker() -> None:
            while time.monotonic() < end:
                if on_tick is not None:
                    on_tick()
                await asyncio.sleep(0.5)

        async with httpx.AsyncClient(headers=self.headers, limits=limits, timeout=120) as client:
            await asyncio.gather(ticker(), *(client_loop(client) for _ in range(clients)))


def soak(url: str, pid: int | None, *, duration: float, clients: int = 8, warmup: float = 0.3,
         api_key: str | None = None, model: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Run the mix for ``duration`` seconds; the report (counts, problems, RSS, pool gauges) as a dict."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    cards = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"]
    gen = [c for c in cards if c.get("architecture") != "encoder_only"]
    enc = [c for c in cards if c.get("architecture") == "encoder_only"]
    card = next(c for c in gen if model in (None, c["id"]))
    s = Soak(url, api_key, card["id"], card["max_model_len"], enc[0]["id"] if enc else None, seed)
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()

    def tick() -> None:
        if pid is not None:
            samples.append((time.monotonic() - t0, rss_bytes(pid)))

    asyncio.run(s.run(duration, clients, tick))
    gauges = wait_idle(url, api_key)
    time.sleep(0.5)
    tick()
    after = [(t, r) for t, r in samples if t >= warmup * duration]
    base = after[0][1] if after else 0
    final = samples[-1][1] if samples else 0
    slope = _slope(after)
    pool_ok = all(g.get("kv_blocks_used") == 0 and g.get("running") == 0 and g.get("waiting") == 0
                  and g.get("kv_blocks_free") == g.get("kv_blocks_total") for g in gauges.values())
    return {"duration_s": duration, "clients": clients, "requests": sum(s.counts.values()),
            "counts": dict(sorted(s.counts.items())), "problems": s.problems[:30], "problem_count": len(s.problems),
            "rss_mib": {"start": _mib(samples[0][1]) if samples else None, "after_warmup": _mib(base),
                        "end": _mib(final), "max": _mib(max((r for _, r in samples), default=0)),
                        "growth_after_warmup": _mib(final - base),
                        "slope_mib_per_min": round(slope * 60 / MIB, 3) if slope is not None else None},
            "pool": {m: {k: g.get(k) for k in ("kv_blocks_total", "kv_blocks_used", "kv_blocks_free", "running",
                                               "waiting", "requests_aborted", "requests_failed")}
                     for m, g in gauges.items()},
            "pool_idle": pool_ok}


def _mib(b: int) -> float:
    return round(b / MIB, 2)


def _slope(samples: list[tuple[float, int]]) -> float | None:
    """Least-squares RSS growth in bytes per second."""
    if len(samples) < 3:
        return None
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mr = sum(r for _, r in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    return sum((t - mt) * (r - mr) for t, r in samples) / var if var else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url")
    ap.add_argument("--pid", type=int, help="the service's process id (for RSS) with --url")
    ap.add_argument("--config", help="service config to start (default: the embedded default model)")
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--warmup", type=float, default=0.3)
    ap.add_argument("--model")
    ap.add_argument("--api-key")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    service = None
    url, pid = args.url, args.pid
    if url is None:
        service = ServiceProcess(args.config or {"models": [{"name": "default"}]})
        url, pid = service.url, service.pid
        print(f"started inferflow-service (pid {pid}) at {url}", file=sys.stderr)
    try:
        report = soak(url.rstrip("/"), pid, duration=args.duration, clients=args.clients, warmup=args.warmup,
                      api_key=args.api_key, model=args.model, seed=args.seed)
    finally:
        if service is not None:
            status = service.stop()
            print(f"inferflow-service exited with status {status}", file=sys.stderr)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["problems"] or not report["pool_idle"] else 0


if __name__ == "__main__":
    sys.exit(main())
