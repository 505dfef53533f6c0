"""Service-level Prometheus metrics: requests by route and status, tokens, TTFT / TPOT / latency histograms.

Engine gauges (queue depth, KV usage, prefix hit rate, ...) come from each model's ``engine.metrics()`` and are
rendered next to these with a ``model`` label. Text exposition format 0.0.4, no client library needed.
"""
from __future__ import annotations

import threading
from bisect import bisect_left
from collections import defaultdict
from typing import Any, Iterable

# vLLM's buckets, so existing dashboards read these the same way
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    esc = (str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, esc)) + "}"


def _num(v: float) -> str:
    return repr(float(v)) if v != int(v) or abs(v) > 2 ** 53 else str(int(v))


class Histogram:
    def __init__(self, buckets: Iterable[float]):
        self.buckets = tuple(buckets)
        self.counts: dict[tuple, list[int]] = defaultdict(lambda: [0] * (len(self.buckets) + 1))
        self.sums: dict[tuple, float] = defaultdict(float)

    def observe(self, value: float, labels: tuple) -> None:
        self.counts[labels][bisect_left(self.buckets, value)] += 1
        self.sums[labels] += value

    def render(self, name: str, keys: tuple[str, ...]) -> list[str]:
        out = []
        for labels, counts in sorted(self.counts.items()):
            base = dict(zip(keys, labels))
            acc = 0
            for bound, c in zip(self.buckets + (float("inf"),), counts):
                acc += c
                le = "+Inf" if bound == float("inf") else repr(bound)
                out.append(f"{name}_bucket{_labels({**base, 'le': le})} {acc}")
            out.append(f"{name}_sum{_labels(base)} {_num(self.sums[labels])}")
            out.append(f"{name}_count{_labels(base)} {acc}")
        return out


class ServiceMetrics:
    """Counters and histograms the routes update; ``render`` adds each engine's own gauges."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)        # (route, status) -> count
        self.prompt_tokens: dict[str, int] = defaultdict(int)
        self.generation_tokens: dict[str, int] = defaultdict(int)
        self.finished: dict[tuple[str, str], int] = defaultdict(int)        # (model, finish_reason) -> count
        self.in_flight = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)

    def request_done(self, route: str, status: int) -> None:
        with self.lock:
            self.requests[(route, str(status))] += 1

    def generation_done(self, model: str, prompt_tokens: int, output_tokens: int, ttft: float | None,
                        latency: float, finish_reasons: Iterable[str | None], longest: int | None = None) -> None:
        """One finished generation: tokens, time to first token, time per output token after the first (over
        the ``longest`` of its sequences: n samples are decoded side by side)."""
        with self.lock:
            self.prompt_tokens[model] += prompt_tokens
            self.generation_tokens[model] += output_tokens
            for r in finish_reasons:
                self.finished[(model, r or "abort")] += 1
            if ttft is not None:
                self.ttft.observe(ttft, (model,))
                steps = output_tokens if longest is None else longest
                if steps > 1:
                    self.tpot.observe((latency - ttft) / (steps - 1), (model,))
            self.latency.observe(latency, (model,))

    def render(self, engines: dict[str, Any]) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, help_: str) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])

        with self.lock:
            family("inferflow_http_requests_total", "counter", "HTTP requests by route and status code.")
            for (route, status), n in sorted(self.requests.items()):
                lines.append(f"inferflow_http_requests_total{_labels({'route': route, 'status': status})} {n}")
            family("inferflow_requests_in_flight", "gauge", "Requests being generated now.")
            lines.append(f"inferflow_requests_in_flight {self.in_flight}")
            family("inferflow_request_success_total", "counter", "Finished sequences by finish reason.")
            for (model, reason), n in sorted(self.finished.items()):
                lines.append(f"inferflow_request_success_total{_labels({'model': model, 'finish_reason': reason})} {n}")
            family("inferflow_prompt_tokens_total", "counter", "Prompt tokens processed.")
            for model, n in sorted(self.prompt_tokens.items()):
                lines.append(f"inferflow_prompt_tokens_total{_labels({'model': model})} {n}")
            family("inferflow_generation_tokens_total", "counter", "Tokens generated.")
            for model, n in sorted(self.generation_tokens.items()):
                lines.append(f"inferflow_generation_tokens_total{_labels({'model': model})} {n}")
            for hist, name, help_ in ((self.ttft, "inferflow_time_to_first_token_seconds", "Time to first token."),
                                      (self.tpot, "inferflow_time_per_output_token_seconds",
                                       "Time per output token after the first."),
                                      (self.latency, "inferflow_e2e_request_latency_seconds", "Request latency.")):
                family(name, "histogram", help_)
                lines.extend(hist.render(name, ("model",)))
        lines.extend(engine_gauges(engines))
        return "\n".join(lines) + "\n"


def _flatten(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, bool):
        out[prefix] = float(value)
    elif isinstance(value, (int, float)):
        out[prefix] = float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}_{k}" if prefix else str(k), v, out)


def engine_gauges(engines: dict[str, Any]) -> list[str]:
    """Each engine's ``metrics()`` numbers as ``inferflow_engine_<key>{model=...}`` gauges."""
    per_key: dict[str, list[str]] = defaultdict(list)
    for model, engine in sorted(engines.items()):
        try:
            values: dict[str, float] = {}
            _flatten("", engine.metrics(), values)
        except Exception:  # a metrics scrape must not fail because one engine is shutting down
            continue
        for key, v in values.items():
            name = "inferflow_engine_" + "".join(c if c.isalnum() else "_" for c in key)
            per_key[name].append(f"{name}{_labels({'model': model})} {_num(v)}")
    lines = []
    for name, samples in sorted(per_key.items()):
        lines += [f"# TYPE {name} gauge", *samples]
    return lines
