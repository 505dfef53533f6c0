"""Offline throughput: prefill and decode tokens/s of a fixed batch of prompts, and peak memory.

A *system* (inferflow's engine here, the peers in peers.py) is a callable ``run(prompts, new_tokens) ->
RunSample``. Prefill tokens/s = prompt tokens / time until every request has its first token; decode tokens/s
= tokens generated after each request's first / time after that point (a serving engine's decode rate).
Greedy, EOS ignored: every request makes exactly ``new_tokens`` tokens. The systems run interleaved (every
system once per batch size per round) and each metric is the median over rounds: a shared machine's speed
drifts by tens of percent within seconds, and interleaving spreads that drift over all systems alike.
"""
from __future__ import annotations

import os
import random
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..engine import Engine, EngineConfig, SamplingParams


@dataclass(slots=True)
class RunSample:
    prefill_tokens: int
    prefill_s: float
    decode_tokens: int
    decode_s: float
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


class PeerDied(RuntimeError):
    """A peer's worker process ended (crashed) during a run: the benchmark drops that peer and goes on."""


def rss_mb() -> float:
    """Resident memory of this process now (MiB)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return peak_rss_mb()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_prompts(n: int, length: int, vocab: int, seed: int = 0, skip: int = 10) -> list[list[int]]:
    """``n`` prompts of ``length`` random ids in [skip, vocab) (low ids are often special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(skip, max(skip + 1, vocab)) for _ in range(length)] for _ in range(n)]


def file_prompts(path: str, n: int, tokenizer: Any, length: int | None = None) -> list[list[int]]:
    """Prompts from a text file, one per line (cycled to ``n``), tokenized; cut to ``length`` tokens if given."""
    lines = [ln.strip() for ln in open(path, encoding="utf-8") if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts")
    ids = [tokenizer.encode(lines[i % len(lines)]) for i in range(n)]
    return [x[:length] if length else x for x in ids]


class InferflowSystem:
    """inferflow's Engine: one per model, reused across rounds; prefix caching off so every round prefills."""

    name = "inferflow"

    def __init__(self, model: Any, max_seqs: int, max_len: int, max_batched_tokens: int, kv_cache_dtype: str = "auto"):
        self.model, self.device = model, str(model.device)
        self.engine = Engine(model, EngineConfig(max_num_seqs=max_seqs, max_model_len=max_len,
                                                 max_num_batched_tokens=max(2048, max_batched_tokens),
                                                 enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype))

    def __call__(self, prompts: list[list[int]], n: int) -> RunSample:
        eng = self.engine
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        g0 = eng.counters.generation_tokens
        sync(self.device)
        t0 = time.perf_counter()
        handles = [eng.add_request(p, params) for p in prompts]
        t_first = g_first = None
        while eng.has_unfinished():
            eng.step()
            if t_first is None and eng.counters.generation_tokens - g0 >= len(prompts):
                sync(self.device)
                t_first, g_first = time.perf_counter(), eng.counters.generation_tokens
        sync(self.device)
        t_end = time.perf_counter()
        outs = [h.result().outputs[0].token_ids for h in handles]
        return RunSample(sum(map(len, prompts)), t_first - t0, eng.counters.generation_tokens - g_first,
                         t_end - t_first, outs)


def measure(systems: dict[str, Callable], prompts: dict[int, list[list[int]]], new_tokens: int, rounds: int,
            log: Callable[[str], None] = print, batches_of: dict[str, Sequence[int]] | None = None,
            device: str = "cpu", notes: list[str] | None = None) -> list[dict[str, Any]]:
    """Interleaved rounds; per (system, batch): median prefill/decode tok/s over rounds, samples, peak memory.

    ``batches_of[name]``: the batch sizes a system runs (a single-sequence peer: [1]); default all."""
    batches_of = batches_of or {}
    runs = {name: [b for b in prompts if b in batches_of.get(name, prompts)] for name in systems}
    samples: dict[tuple[str, int], list[RunSample]] = {}
    peak: dict[tuple[str, int], float] = {}
    dropped: list[str] = []
    for name, run in systems.items():  # warm-up: allocator, kernels, lazy imports
        if runs[name]:
            try:
                run(prompts[min(runs[name])][:1], 2)
            except PeerDied as e:
                runs[name] = []
                dropped.append(f"{name} crashed in its warm-up ({e})")
    for r in range(rounds):
        for b, ps in prompts.items():
            for name, run in systems.items():
                if b not in runs[name]:
                    continue
                if device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                try:
                    s = run(ps, new_tokens)
                except PeerDied as e:
                    log(f"{name}: {e}; dropped from the rest of the benchmark")
                    runs[name] = []
                    dropped.append(f"{name} crashed during the run ({e}); its figures are missing")
                    continue
                mem = torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else rss_mb()
                if hasattr(run, "memory_mb"):  # a peer in its own process (llama.cpp): that process's peak
                    mem = run.memory_mb()
                peak[(name, b)] = max(peak.get((name, b), 0.0), mem)
                samples.setdefault((name, b), []).append(s)
                log(f"round {r + 1}/{rounds}  batch {b:<3} {name:<18} prefill {s.prefill_tps:9.1f} tok/s  "
                    f"decode {s.decode_tps:8.1f} tok/s")
    if notes is not None:
        notes += dropped
    out = []
    for (name, b), ss in samples.items():
        dec = statistics.median(s.decode_tps for s in ss)
        out.append({"system": name, "batch": b, "prefill_tps": statistics.median(s.prefill_tps for s in ss),
                    "decode_tps": dec, "decode_ms_per_step": 1000 * b / dec if dec else None,
                    "prefill_samples": [s.prefill_tps for s in ss], "decode_samples": [s.decode_tps for s in ss],
                    "mem_mb": peak[(name, b)], "mem_kind": "cuda_max_allocated" if device.startswith("cuda")
                    else "process_rss", "process_peak_rss_mb": peak_rss_mb(), "outputs": ss[-1].outputs})
    return out


def ratios(results: list[dict[str, Any]], ours: str, peers: Sequence[str]) -> list[dict[str, Any]]:
    """ours / peer for each metric and batch both ran."""
    by = {(r["system"], r["batch"]): r for r in results}
    out = []
    for peer in peers:
        for (name, b), r in sorted(by.items(), key=lambda kv: kv[0][1]):
            p = by.get((peer, b))
            if name != ours or p is None:
                continue
            same = sum(x == y for x, y in zip(r["outputs"], p["outputs"]))
            out.append({"ours": ours, "peer": peer, "batch": b,
                        "prefill_tps": r["prefill_tps"] / p["prefill_tps"] if p["prefill_tps"] else None,
                        "decode_tps": r["decode_tps"] / p["decode_tps"] if p["decode_tps"] else None,
                        "same_greedy_tokens": f"{same}/{len(r['outputs'])}"})
    return out
