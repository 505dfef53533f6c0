"""inferflow's side of tools/bench_gpu.py: loading the HF model's own tensors (``MemorySource``, ``load_shared``),
the timed engine runs (decode, serving load, prefill), a decode graph's GPU time, and the helpers both systems'
runs share (``log``, ``sync``, ``leading_same``). Imported through tools/bench_gpu.py, which puts the repository
on ``sys.path``.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

import inferflow
from inferflow.engine import Engine, SamplingParams
from inferflow.loaders.source import WeightSource

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


class MemorySource(WeightSource):
    """An HF state dict in memory as a weight source (the same tensors: nothing copied for equal dtypes)."""

    kind = "hf"

    def __init__(self, sd: dict[str, torch.Tensor], config: dict[str, Any], folder: str):
        self.sd, self.config, self.path = sd, config, folder
        self.config_name = os.path.join(folder, "config.json")

    def names(self) -> list[str]:
        return list(self.sd)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.sd[name].shape)

    def get(self, name: str) -> torch.Tensor:
        return self.sd[name]


def load_shared(hf: Any, folder: str, device: str, **kw: Any) -> Any:
    """inferflow.load over the HF model's own tensors (config.json written to ``folder``)."""
    import inferflow.model.model as mm

    hf.config.save_pretrained(folder)
    cfg = json.loads(Path(folder, "config.json").read_text())
    src = MemorySource({k: v for k, v in hf.state_dict().items()}, cfg, folder)
    orig = mm.open_source
    mm.open_source = lambda _: src
    try:
        return inferflow.load(folder, dtype="bfloat16", device=device, **kw)
    finally:
        mm.open_source = orig


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def ours_decode(eng: Engine, prompts: list[list[int]], n: int, device: str) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    g0 = eng.counters.generation_tokens
    handles = [eng.add_request(p, params) for p in prompts]
    t_first = g_first = None
    while eng.has_unfinished():
        eng.step()
        if t_first is None and eng.counters.generation_tokens - g0 >= len(prompts):
            sync(device)
            t_first, g_first = time.perf_counter(), eng.counters.generation_tokens
    sync(device)
    dt = time.perf_counter() - t_first
    return (eng.counters.generation_tokens - g_first) / dt, [h.result().outputs[0].token_ids for h in handles]


def ours_serving(eng: Engine, prompts: list[list[int]], n: int, device: str) -> dict[str, float]:
    """All requests queued at once (an offline serving load); TTFT per request from its arrival, throughput."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    sync(device)
    g0 = eng.counters.generation_tokens
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"serve-{i}")
    first: dict[str, float] = {}
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter() - t0
        for o in outs:
            rid = getattr(o, "request_id", None)
            if rid is not None and rid not in first and o.outputs and o.outputs[0].token_ids:
                first[rid] = now
    sync(device)
    dt = time.perf_counter() - t0
    ttft = sorted(first.values()) or [float("nan")]
    q = lambda f: ttft[min(len(ttft) - 1, int(f * len(ttft)))] * 1e3  # noqa: E731
    return {"requests": len(prompts), "duration_s": dt, "output_tok_s": (eng.counters.generation_tokens - g0) / dt,
            "total_tok_s": (eng.counters.generation_tokens - g0 + sum(map(len, prompts))) / dt,
            "ttft_ms_median": q(0.5), "ttft_ms_p99": q(0.99), "ttft_ms_min": q(0.0)}


def ours_prefill(eng: Engine, prompts: list[list[int]], device: str) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    sync(device)
    t0 = time.perf_counter()
    handles = [eng.add_request(p, params) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    sync(device)
    dt = time.perf_counter() - t0
    assert all(h.result().outputs[0].token_ids for h in handles)
    return sum(map(len, prompts)) / dt


def graph_gpu_ms(eng: Engine, batches: list[int]) -> dict[int, float]:
    """GPU time of one replay of each bucket's decode graph (the step without the host's work around it)."""
    out = {}
    graphs = eng.runner.graphs
    for b in batches:
        hit = graphs._graphs.get(graphs.bucket(b)) if graphs is not None else None
        if hit is None:
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        hit[0].replay()
        start.record()
        for _ in range(20):
            hit[0].replay()
        end.record()
        torch.cuda.synchronize()
        out[b] = start.elapsed_time(end) / 20
    return out


def leading_same(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
