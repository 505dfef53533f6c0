"""Where a CPU decode step goes: ms per engine step, then the native program's ms per op (or, op by op, a
torch.profiler table) and a cProfile of Python.

    PYTHONPATH=. python tools/profile_cpu.py MODEL.gguf [--threads 2] [--steps 10] [--batch 1] [--op-by-op]
                                                       [--dtype float32] [--grain WEIGHTS]

``--batch`` requests (128-token prompts, greedy) decoding together through the Engine. Where the model lowers to the native decode
program (inferflow/model/native_decode.py) its ops are timed inside the step (each op until every thread finished
it), summed over the layers; ``--op-by-op`` switches the program off (EngineConfig.native_decode=False) to profile
that path. ``--grain`` sets the native block GEMV's weights-per-thread threshold (inferflow/native/gemv_ggml.c).
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


def print_program(eng: Engine, prog, steps: int) -> None:
    """ms per step of each op of the native decode program, summed over layers, most first."""
    times = torch.zeros(len(prog), dtype=torch.float64)
    run = prog.run
    prog.run = lambda st, n: run(st, n, times)
    try:
        for _ in range(steps):
            eng.step()
    finally:
        del prog.run
    agg: dict[str, list[float]] = {}
    for name, t in zip(prog.names, times.tolist()):
        agg.setdefault(name, [0.0, 0])
        agg[name][0] += t / steps * 1e3
        agg[name][1] += 1
    print(f"native decode program: {len(prog)} ops, {times.sum().item() / steps * 1e3:.2f} ms per step")
    print(f"{'ms/step':>8}  {'calls':>5}  op")
    for name, (ms, n) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
        print(f"{ms:8.3f}  {n:5d}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--grain", type=int, default=None)
    ap.add_argument("--op-by-op", action="store_true", help="native decode program off")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.grain:
        from inferflow.quant import native_linear

        native_linear.set_grain(args.grain)
    eng = Engine(inferflow.load(args.model, dtype=args.dtype), EngineConfig(max_num_seqs=8, max_model_len=512,
                                                                                  native_decode=not args.op_by_op))
    for i in range(args.batch):
        eng.add_request(list(range(10 + i, 138 + i)), SamplingParams(temperature=0.0, max_tokens=10 * args.steps + 64,
                                                                     ignore_eos=True))
    for _ in range(2 * args.steps):  # prefill, then warm decode steps
        eng.step()
    t = time.perf_counter()
    for _ in range(2 * args.steps):
        eng.step()
    print(f"decode step: {(time.perf_counter() - t) / (2 * args.steps) * 1e3:.2f} ms")
    prog = eng.runner.native.prog if eng.runner.native is not None else None
    if prog is not None:
        print_program(eng, prog, args.steps)
    else:
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
