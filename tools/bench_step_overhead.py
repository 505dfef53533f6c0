"""Host overhead of one engine step, split by phase, on a tiny model (its forward is negligible).

    PYTHONPATH=. python tools/bench_step_overhead.py [--batches 1,8,64,256] [--tokens 24] [--rounds 3]

Runs ``batch`` streaming requests (EOS ignored, every request produces ``--tokens`` tokens) through the Engine,
greedy and sampled (temperature 0.8, top_p 0.9), with a consumer draining every handle's stream after each step,
and reports per pure-decode step the median host milliseconds of each phase: schedule, batch (building the
forward's tensors), model (``forward_packed``: the tiny forward itself), sample, append (stop checks,
detokenize), emit (delta outputs to the streams), other (the rest of ``Engine.step``). "host" = step - model.
Modes are interleaved round by round (the machine is shared and noisy) and medians over rounds are printed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PHASES = ("schedule", "batch", "model", "sample", "append", "emit", "other")


def _timed(acc: dict, key: str, fn):
    def wrap(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t
    return wrap


def run_once(model, batch: int, tokens: int, sampled: bool) -> dict[str, float]:
    from inferflow.engine import Engine, EngineConfig, SamplingParams

    bs = 16
    cfg = EngineConfig(block_size=bs, num_blocks=batch * (-(-(8 + tokens) // bs) + 1) + 8,
                       max_num_seqs=max(batch, 1), max_num_batched_tokens=max(batch * 8, 256))
    eng = Engine(model, cfg)
    acc: dict[str, float] = defaultdict(float)
    eng.scheduler.schedule = _timed(acc, "schedule", eng.scheduler.schedule)
    eng.runner.run = _timed(acc, "batch", eng.runner.run)          # minus model below
    eng.model.forward_packed = _timed(acc, "model", model.__class__.forward_packed.__get__(model))
    base = type(eng.sampler)
    eng.sampler.__class__ = type("TimedSampler", (base,), {"__call__": _timed(acc, "sample", base.__call__)})
    eng._append = _timed(acc, "append", eng._append)
    eng._emit = _timed(acc, "emit", eng._emit)
    p = (SamplingParams(temperature=0.8, top_p=0.9, max_tokens=tokens, ignore_eos=True, seed=None) if sampled
         else SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    g = torch.Generator().manual_seed(batch)
    handles = [eng.add_request(torch.randint(3, 90, (8,), generator=g).tolist(), p) for _ in range(batch)]
    rows = []
    while eng.has_unfinished():
        acc.clear()
        t = time.perf_counter()
        eng.step()
        total = time.perf_counter() - t
        for h in handles:  # the streaming consumer
            while h._request.stream.get(0) is not None:
                pass
        if eng.counters.last_step_tokens == batch and all(len(h._request.seqs[0].output_ids) > 1 for h in handles):
            acc["batch"] -= acc["model"]
            acc["other"] = total - sum(acc.values())
            rows.append({k: acc[k] * 1e3 for k in PHASES} | {"step": total * 1e3})
    del eng.model.forward_packed
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    import engine_models
    model = engine_models.llama(Path(tempfile.mkdtemp()))
    batches = [int(b) for b in a.batches.split(",")]
    res: dict[tuple[int, bool], list[dict]] = defaultdict(list)
    with torch.inference_mode():
        run_once(model, 2, 4, False)  # warm-up
        for _ in range(a.rounds):
            for b in batches:
                for s in (False, True):
                    res[(b, s)].append(run_once(model, b, a.tokens, s))
    print(f"median ms per pure-decode step over {a.rounds} rounds (host = step - model)")
    print(f"{'batch':>5} {'mode':>6} {'host':>7} {'step':>7} " + " ".join(f"{p:>8}" for p in PHASES))
    for b in batches:
        for s in (False, True):
            rs = res[(b, s)]
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            print(f"{b:>5} {'sample' if s else 'greedy':>6} {med['step'] - med['model']:7.2f} {med['step']:7.2f} "
                  + " ".join(f"{med[p]:8.3f}" for p in PHASES))


if __name__ == "__main__":
    main()
