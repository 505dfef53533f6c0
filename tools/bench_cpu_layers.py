"""CPU/GPU hybrid (``cpu_layers``): correctness against the all-GPU model and decode speed, one process.

    python tools/bench_cpu_layers.py MODEL_DIR [--cpu-layers 0,2,4,8] [--tokens 32] [--dtype bfloat16]

Correctness: float32 logits of a prompt with the first N layers on the CPU vs all on the GPU (max |diff| / max |ref|).
Speed: ms per decoded token with Model.generate_ids (one sequence, EOS ignored), median of interleaved rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import inferflow  # noqa: E402
from inferflow.parallel.hybrid import place_cpu_layers  # noqa: E402


def load(model: str, dtype: str, n: int) -> inferflow.Model:
    m = inferflow.load(model, dtype=dtype, device="cuda")
    if n:
        place_cpu_layers(m, n)
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--cpu-layers", default="0,2,4,8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    counts = [int(c) for c in args.cpu_layers.split(",")]
    prompt = list(range(5, 21))
    ref = load(args.model, "float32", 0).logits(prompt)
    for n in counts[1:]:
        got = load(args.model, "float32", n).logits(prompt)
        print(f"cpu_layers={n}: float32 max|diff|/max|ref| = {((got - ref).abs().max() / ref.abs().max()).item():.2e}")
    del ref
    models = {n: load(args.model, args.dtype, n) for n in counts}
    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(args.rounds):
        for n, m in models.items():
            m.generate_ids(prompt, max_new_tokens=2, stop_ids=set())
            torch.cuda.synchronize()
            t = time.perf_counter()
            m.generate_ids(prompt, max_new_tokens=args.tokens, stop_ids=set())
            torch.cuda.synchronize()
            times[n].append((time.perf_counter() - t) / args.tokens * 1000)
    print(f"| cpu_layers | ms/token ({args.dtype}) |\n|---:|---:|")
    for n in counts:
        print(f"| {n} | {statistics.median(times[n]):.1f} |")


if __name__ == "__main__":
    main()
