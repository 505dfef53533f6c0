"""Load test of an inferflow service: concurrent clients sending /v1/completions requests (streamed by default).

    python tools/loadtest.py --url http://127.0.0.1:8080 [--model NAME] [--api-key KEY]
    python tools/loadtest.py --config service.yaml          # starts inferflow-service itself (SIGTERM at the end)
    python tools/loadtest.py                                # starts the embedded default model
        [--clients 64] [--duration 30 | --requests 4] [--prompt-words 8] [--max-tokens 16] [--no-stream]
        [--json out.json]

Each client sends one request at a time, greedy with EOS ignored (every accepted request produces exactly
``max_tokens`` tokens). An overloaded server answers 429 / 503 with Retry-After: the client waits that long (at
most ``--max-backoff`` seconds) and tries again. Prints (and writes as JSON) the status-code counts, latency and
time-to-first-token percentiles of the accepted requests, throughput, and every anomaly (a transport error, an
accepted stream without ``[DONE]`` or with an error event, an overload answer without Retry-After).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing near river".split()


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it."""

    prompt: int                      # index into the prompts
    status: int                      # HTTP status; 0: a transport error
    latency: float                   # seconds to the last byte
    ttft: float | None = None        # seconds to the first text
    text: str = ""
    finish_reason: str | None = None
    tokens: int = 0                  # completion tokens (usage)
    retry_after: str | None = None
    problem: str | None = None       # what was wrong with an accepted (or malformed) answer


def make_prompts(count: int, words: int) -> list[str]:
    """``count`` distinct prompts of ``words`` words."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words)) + f" {i}" for i in range(count)]


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], prompt: int) -> Outcome:
    t0 = time.perf_counter()
    out = Outcome(prompt, 0, 0.0)
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            out.status = r.status_code
            out.retry_after = r.headers.get("retry-after")
            if r.status_code != 200:
                await r.aread()
                if r.status_code in (429, 503) and out.retry_after is None:
                    out.problem = f"{r.status_code} without Retry-After"
                return out
            if not body.get("stream"):
                data = json.loads(await r.aread())
                out.text = data["choices"][0]["text"]
                out.finish_reason = data["choices"][0]["finish_reason"]
                out.tokens = data["usage"]["completion_tokens"]
                return out
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.problem = f"error event: {event['error'].get('message')}"
                for c in event.get("choices", []):
                    if c.get("text") and out.ttft is None:
                        out.ttft = time.perf_counter() - t0
                    out.text += c.get("text") or ""
                    out.finish_reason = c.get("finish_reason") or out.finish_reason
                if event.get("usage"):
                    out.tokens = event["usage"]["completion_tokens"]
            if not done:
                out.problem = out.problem or "stream ended without [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        out.status, out.problem = out.status or 0, f"{type(e).__name__}: {e}"
    finally:
        out.latency = time.perf_counter() - t0
    return out


async def run_load(url: str, prompts: list[Any], *, clients: int, max_tokens: int, duration: float | None = None,
                   requests: int | None = None, model: str | None = None, api_key: str | None = None,
                   stream: bool = True, max_backoff: float = 0.5, timeout: float = 300.0) -> list[Outcome]:
    """``clients`` concurrent clients, each sending ``requests`` accepted requests (overload answers are retried)
    or sending until ``duration`` seconds passed; prompts (text or token ids) are used round-robin."""
    if (duration is None) == (requests is None):
        raise ValueError("give exactly one of duration and requests")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # idle connections expire well before uvicorn's 5 s keep-alive timeout: reusing one the server is closing at
    # that moment would fail the request (a client-side race, not a server fault)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients, keepalive_expiry=2.0)
    outcomes: list[Outcome] = []
    end = time.monotonic() + duration if duration is not None else None
    counter = iter(range(1 << 62))

    async def client_loop(client: httpx.AsyncClient) -> None:
        accepted = 0
        while (end is None and accepted < requests) or (end is not None and time.monotonic() < end):
            i = next(counter) % len(prompts)
            body = {"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            if model:
                body["model"] = model
            out = await one_request(client, url, body, i)
            outcomes.append(out)
            if out.status == 200:
                accepted += 1
            elif out.status in (429, 503):
                await asyncio.sleep(min(max_backoff, float(out.retry_after or max_backoff)))
            else:
                return  # anything else is an anomaly: reported, not retried

    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return outcomes


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summarize(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == 200 and o.problem is None]
    lat = [o.latency for o in ok]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    tokens = sum(o.tokens for o in ok)
    return {
        "requests": len(outcomes), "accepted": len(ok), "wall_s": round(wall, 3),
        "status_counts": dict(sorted(Counter(str(o.status) for o in outcomes).items())),
        "throughput_req_s": round(len(ok) / wall, 3) if wall else None,
        "throughput_tok_s": round(tokens / wall, 2) if wall else None,
        "latency_s": {**{f"p{q}": _r(_pct(lat, q)) for q in (50, 90, 99)}, "max": _r(max(lat, default=None)),
                      "mean": _r(statistics.fmean(lat) if lat else None)},
        "ttft_s": {f"p{q}": _r(_pct(ttft, q)) for q in (50, 90, 99)},
        "problems": [f"prompt {o.prompt}: status {o.status}: {o.problem}" for o in outcomes if o.problem][:20],
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def print_summary(s: dict[str, Any], file: Any = sys.stdout) -> None:
    lat, ttft = s["latency_s"], s["ttft_s"]
    print(f"requests {s['requests']} (accepted {s['accepted']}) in {s['wall_s']} s; status counts "
          f"{s['status_counts']}", file=file)
    print(f"throughput {s['throughput_req_s']} req/s, {s['throughput_tok_s']} tokens/s", file=file)
    print(f"latency p50 {lat['p50']} p90 {lat['p90']} p99 {lat['p99']} max {lat['max']} s; "
          f"TTFT p50 {ttft['p50']} p90 {ttft['p90']} p99 {ttft['p99']} s", file=file)
    for p in s["problems"]:
        print(f"PROBLEM {p}", file=file)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running service (default: start one)")
    ap.add_argument("--config", help="service config to start (default: the embedded default model)")
    ap.add_argument("--model")
    ap.add_argument("--api-key")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--duration", type=float, help="seconds of load (default 30 unless --requests)")
    ap.add_argument("--requests", type=int, help="accepted requests per client instead of a duration")
    ap.add_argument("--prompt-words", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--max-backoff", type=float, default=0.5)
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    duration = args.duration if args.duration is not None or args.requests is not None else 30.0
    service = None
    url = args.url
    if url is None:
        from tools.service_process import ServiceProcess

        config: Any = args.config or {"models": [{"name": "default"}]}
        service = ServiceProcess(config)
        url = service.url
        print(f"started inferflow-service (pid {service.pid}) at {url}", file=sys.stderr)
    try:
        prompts = make_prompts(args.prompts, args.prompt_words)
        t0 = time.perf_counter()
        outcomes = asyncio.run(run_load(url.rstrip("/"), prompts, clients=args.clients, max_tokens=args.max_tokens,
                                        duration=duration, requests=args.requests, model=args.model,
                                        api_key=args.api_key, stream=not args.no_stream,
                                        max_backoff=args.max_backoff))
        summary = summarize(outcomes, time.perf_counter() - t0)
        summary["settings"] = {k: v for k, v in vars(args).items() if k not in ("api_key", "json")}
    finally:
        if service is not None:
            status = service.stop()
            print(f"inferflow-service exited with status {status}", file=sys.stderr)
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
