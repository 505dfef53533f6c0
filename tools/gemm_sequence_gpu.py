"""Why a prefill's GEMMs run slower in a model than alone: the same cuBLAS GEMMs timed three ways on one GPU.

    python tools/gemm_sequence_gpu.py [--rows 8192] [--std 0.02] [--reps 5]

The Qwen3-8B layer's four projections (qkv 4096->6144, o 4096->4096, gate/up 4096->24576, down 12288->4096) at
``--rows`` rows, bf16, 36 layers of distinct weights drawn with ``--std``:
- ``alone``: each projection repeated on one weight (how tools/profile_gpu.py's floor is taken), x 36;
- ``sequence``: the 36 layers' projections back to back, each on its own weights, as a prefill runs them;
- ``sequence + elementwise``: the same with a memory-bound copy of the GEMM output after each projection.
GPU ms from CUDA events (median of ``--reps``); run ``nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv
-lms 100`` beside it to see the clocks. No timing is asserted anywhere.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 24576), "down": (12288, 4096)}


def timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    n, L = args.rows, args.layers
    ws = [{k: torch.randn(o, i, device="cuda", dtype=torch.bfloat16) * args.std for k, (i, o) in SHAPES.items()}
          for _ in range(L)]
    xs = {i: torch.randn(n, i, device="cuda", dtype=torch.bfloat16) for i in {4096, 12288}}

    def alone() -> float:
        total = 0.0
        for k, (i, _) in SHAPES.items():
            w, x = ws[0][k], xs[i]
            total += timed(lambda: [F.linear(x, w) for _ in range(10)], args.reps) / 10 * L
        return total

    def sequence(copy: bool) -> float:
        def run() -> None:
            for lw in ws:
                for k, (i, _) in SHAPES.items():
                    y = F.linear(xs[i], lw[k])
                    if copy:
                        y.mul_(0.5)
        return timed(run, args.reps)

    flops = 2 * n * L * sum(i * o for i, o in SHAPES.values())
    for name, fn in (("alone", alone), ("sequence", lambda: sequence(False)),
                     ("sequence + elementwise", lambda: sequence(True)), ("alone again", alone),
                     ("sequence again", lambda: sequence(False))):
        ms = fn()
        print(f"{name}: {ms:.2f} ms, {flops / ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
