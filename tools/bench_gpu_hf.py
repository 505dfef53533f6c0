"""HF transformers' side of tools/bench_gpu.py: greedy decoding with a ``StaticCache`` and a compiled one-token
step (``HFStatic``), HF's prefill two ways (its static-cache path, and a plain eager forward without a cache), and
the decode phase that interleaves both systems (``decode_vs_hf``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench_gpu_ours import graph_gpu_ms, leading_same, ours_decode, sync
from inferflow.engine import Engine


class HFStatic:
    """Greedy decoding with a StaticCache; the one-token step compiled (mode="reduce-overhead": CUDA graphs)."""

    def __init__(self, model: Any, compile_: bool, max_cache_len: int):
        self.model, self.compiled, self.max_cache_len = model, compile_, max_cache_len
        self.caches: dict[int, Any] = {}  # one StaticCache per batch size, reused: no recompiles
        self.step = torch.compile(self._step, mode="reduce-overhead") if compile_ else self._step

    def cache_for(self, b: int, device: str) -> Any:
        """This batch size's StaticCache, emptied (built once, as generate keeps it between calls)."""
        from transformers import StaticCache

        cache = self.caches.get(b)
        if cache is None:
            try:
                cache = StaticCache(config=self.model.config, max_cache_len=self.max_cache_len)
            except TypeError:  # older signature
                cache = StaticCache(config=self.model.config, max_batch_size=b, max_cache_len=self.max_cache_len,
                                    device=device, dtype=torch.bfloat16)
            self.caches[b] = cache
        else:
            cache.reset()
        return cache

    def prefill(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """The prompt's forward into the StaticCache, eager (generate compiles only the one-token step); greedy
        next tokens [B, 1]."""
        out = self.model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(ids.shape[1],
                         device=ids.device), use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def _step(self, tok: torch.Tensor, pos: torch.Tensor, cache: Any) -> torch.Tensor:
        out = self.model(input_ids=tok, past_key_values=cache, cache_position=pos, position_ids=pos[None].expand(
            tok.shape[0], 1), use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def __call__(self, prompts: list[list[int]], n: int, device: str) -> tuple[float, list[list[int]]]:
        ids = torch.tensor(prompts, device=device)  # equal lengths: no padding
        b, p = ids.shape
        cache = self.cache_for(b, device)
        tok = self.prefill(ids, cache)
        toks = [tok]
        sync(device)
        t0 = time.perf_counter()
        for i in range(n - 1):
            if self.compiled:
                torch.compiler.cudagraph_mark_step_begin()
            # clone: a compiled graph's output is overwritten by its next replay
            tok = self.step(tok, torch.tensor([p + i], device=device), cache).clone()
            toks.append(tok)
        sync(device)
        dt = time.perf_counter() - t0
        return b * (n - 1) / dt, torch.cat(toks, 1).tolist()


@torch.inference_mode()
def hf_prefill(model: Any, prompts: list[list[int]], device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    sync(device)
    t0 = time.perf_counter()
    model(input_ids=ids, use_cache=False, logits_to_keep=1)
    sync(device)
    return ids.numel() / (time.perf_counter() - t0)


@torch.inference_mode()
def hf_prefill_static(hf_static: HFStatic, prompts: list[list[int]], device: str) -> float:
    """Prefill tok/s of HF's static-cache path: the prompts' eager forward into a StaticCache, as ``generate``
    with ``cache_implementation="static"`` runs its first step (the cache built once and emptied before each call,
    outside the timing)."""
    ids = torch.tensor(prompts, device=device)
    cache = hf_static.cache_for(ids.shape[0], device)
    sync(device)
    t0 = time.perf_counter()
    hf_static.prefill(ids, cache)
    sync(device)
    return ids.numel() / (time.perf_counter() - t0)


def decode_vs_hf(args: argparse.Namespace, res: dict, eng: Engine, hf: Any, dprompts: dict[int, list[list[int]]],
                 batches: list[int], device: str, left: Any, log: Any) -> None:
    """HF warm-up (torch.compile per batch size), then decode rounds, the two systems interleaved."""
    for b in batches:  # inferflow alone first: kept even if HF's compilation outlasts the run
        res.setdefault("decode_inferflow_before_hf", {})[b] = ours_decode(eng, dprompts[b], args.new_tokens, device)[0]
    log(f"inferflow decode (before HF) {res['decode_inferflow_before_hf']}")
    (Path(args.out) / "bench_gpu.json").write_text(json.dumps(res, indent=1, default=str))
    hf_len = args.prompt_len + args.new_tokens + 8
    hf_static = HFStatic(hf, not args.no_compile and device == "cuda", hf_len)
    for b in batches:  # HF warm-up: torch.compile per batch size
        try:
            hf_static(dprompts[b], 4, device)
        except Exception as e:  # noqa: BLE001 - report, then measure HF uncompiled
            res["hf_compile_error"] = f"{type(e).__name__}: {e}"[:2000]
            log(res["hf_compile_error"])
            hf_static = HFStatic(hf, False, hf_len)
            hf_static(dprompts[b], 4, device)
        log(f"HF warm-up batch {b} done")
    res["hf_compiled"] = hf_static.compiled
    samples: dict[str, list[float]] = {}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        if r and left() < 30:
            break
        for b in batches:
            for name, fn in ((f"inferflow b{b}", lambda b=b: ours_decode(eng, dprompts[b], args.new_tokens, device)),
                             (f"hf b{b}", lambda b=b: hf_static(dprompts[b], args.new_tokens, device))):
                tps, toks = fn()
                samples.setdefault(name, []).append(tps)
                tokens[name] = toks
                log(f"round {r + 1} {name}: {tps:.1f} tok/s")
    res["decode"] = {k: {"tps": statistics.median(v), "samples": v} for k, v in samples.items()}
    res["greedy_leading_same"] = {b: [leading_same(a, c) for a, c in zip(tokens[f"inferflow b{b}"],
                                                                         tokens[f"hf b{b}"])] for b in batches}
    res["graph_replays"] = eng.runner.graphs.replays if eng.runner.graphs is not None else 0
    res["graph_gpu_ms"] = graph_gpu_ms(eng, batches) if device == "cuda" else {}
    log(f"graph GPU ms per step {res['graph_gpu_ms']}")
