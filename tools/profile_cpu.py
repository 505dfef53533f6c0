"""Where a CPU decode step goes: ms per engine step, then a torch.profiler op table and a cProfile of Python.

    PYTHONPATH=. python tools/profile_cpu.py MODEL.gguf [--threads 2] [--steps 10] [--grain WEIGHTS]

One request (a 128-token prompt, greedy) decoding through the Engine; ``--grain`` sets the native block GEMV's
weights-per-thread threshold (inferflow/native/gemv_ggml.c) for A/B runs.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import inferflow
from inferflow.engine import Engine, EngineConfig, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--grain", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.grain:
        from inferflow.quant import native_linear

        native_linear.set_grain(args.grain)
    eng = Engine(inferflow.load(args.model, dtype=args.dtype), EngineConfig(max_num_seqs=8, max_model_len=512))
    eng.add_request(list(range(10, 138)), SamplingParams(temperature=0.0, max_tokens=10 * args.steps + 64,
                                                         ignore_eos=True))
    for _ in range(2 * args.steps):  # prefill, then warm decode steps
        eng.step()
    t = time.perf_counter()
    for _ in range(2 * args.steps):
        eng.step()
    print(f"decode step: {(time.perf_counter() - t) / (2 * args.steps) * 1e3:.2f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as pr:
        for _ in range(args.steps):
            eng.step()
    print(pr.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    cp = cProfile.Profile()
    cp.enable()
    for _ in range(args.steps):
        eng.step()
    cp.disable()
    pstats.Stats(cp).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
