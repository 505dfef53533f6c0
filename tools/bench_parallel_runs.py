"""The engine runs of tools/bench_parallel.py: placement names (``parse_placement``), engines sized for the
benchmark (``make_engine``), seeded random prompts, timed ``generate`` calls and the tok/s of one repetition
(``speeds``). Imported through tools/bench_parallel.py, which sets up the environment and ``sys.path`` first.
"""
from __future__ import annotations

import re
import time

import torch
import torch.distributed as dist


def parse_placement(name: str):
    if name == "single":
        return None
    m = re.fullmatch(r"(?:tp(\d+))?(?:pp(\d+))?(?:mb(\d+))?", name)
    if not m or not any(m.groups()[:2]):
        raise SystemExit(f"bench_parallel: --placement {name!r}: use single, tpN, ppN, tpNppM (+ mbK: K micro-batches)")
    out = {}
    if m.group(1):
        out["tensor_parallel"] = int(m.group(1))
    if m.group(2):
        out["pipeline_parallel"] = int(m.group(2))
    if m.group(3):
        out["micro_batches"] = int(m.group(3))
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def engine_options(a, pipeline: bool) -> dict:
    """EngineConfig switches that exist in this build: CUDA graphs (never for a pipeline: its stage hand-offs read
    shapes on the host) and fused projections."""
    from dataclasses import fields

    from inferflow.engine import EngineConfig

    have = {f.name for f in fields(EngineConfig)}
    out = {}
    if "cuda_graphs" in have:
        out["cuda_graphs"] = a.cuda_graphs == "on" and not pipeline
    if "fuse_projections" in have and a.fuse != "auto":
        out["fuse_projections"] = a.fuse == "on"
    return out


def make_engine(model, a, pipeline: bool = False):
    from inferflow.engine import Engine, EngineConfig

    need = max(a.decode_batch * (a.decode_prompt + a.decode_tokens + 2), a.prefill_batch * (a.prefill_len + 2))
    blocks = need // 16 + 16
    return Engine(model, EngineConfig(block_size=16, num_blocks=blocks, max_num_seqs=max(a.decode_batch, 1),
                                      max_num_batched_tokens=max(a.prefill_len, a.decode_batch * 2, 2048),
                                      enable_prefix_caching=False, max_model_len=a.prefill_len + a.decode_tokens + 8,
                                      **engine_options(a, pipeline)))


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def timed(engine, prompts, max_tokens: int, device, sink: list | None = None) -> float:
    from inferflow.engine import SamplingParams

    sync(device)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    sync(device)
    bad = [o.error for o in outs if getattr(o, "error", None)]
    if bad:  # the engine fails requests instead of raising: a timing of failures would be meaningless
        raise RuntimeError(f"engine request failed: {bad[0]}")
    if sink is not None:
        sink.extend(o.outputs[0].token_ids for o in outs)
    return time.perf_counter() - t0


def speeds(engine, a, vocab: int, device, rep: int, tokens: list | None = None) -> dict[str, float]:
    """tok/s: prefill (prefill_batch prompts of prefill_len, one token out), decode at batch 1 and decode_batch
    (decode time = generate(1 + D) - generate(1), fresh prompts each time: prefix caching is off anyway)."""
    out = {}
    pre = random_prompts(a.prefill_batch, a.prefill_len, vocab, 100 + rep)
    out["prefill"] = a.prefill_batch * a.prefill_len / timed(engine, pre, 1, device)
    for b in (1, a.decode_batch):
        ps = random_prompts(b, a.decode_prompt, vocab, 200 + rep + b)
        t1 = timed(engine, ps, 1, device)
        t2 = timed(engine, ps, 1 + a.decode_tokens, device, tokens if b == a.decode_batch else None)
        out[f"decode_b{b}"] = b * a.decode_tokens / max(t2 - t1, 1e-9)
    return out
