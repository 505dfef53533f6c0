"""The native block GEMV (inferflow/native/gemv_ggml.c) on weights in cache vs streamed from memory.

    PYTHONPATH=. python tools/bench_native_stream.py [--threads 2] [--types Q4_0,Q8_0] [--mib 512] [--rounds 3]

A decode step reads every weight once, from memory: "hot" times one weight called over and over (it stays in L2),
"cold" cycles through copies of it filling --mib MiB, as a model's layers do. Prints us per call and GB/s of
blocks read, medians of --rounds interleaved rounds: the exact decode (gemv) and, for Q4_0 / Q4_1 / Q8_0 where the
build has VNNI, the int8-activation kernel (gemv_q8x, the default at decode).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import gguf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # random GGUF blocks

from inferflow.quant import ggml, native_linear  # noqa: E402
from gguf_files import random_blocks  # noqa: E402

SHAPES = [(3072, 576), (576, 1536), (49152, 576)]


def per_call(copies: list[torch.Tensor], qtype: int, shape: tuple[int, int], x: torch.Tensor, calls: int,
             fn=native_linear.gemv) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        fn(copies[i % len(copies)], qtype, shape, x)
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default="Q4_0,Q8_0")
    ap.add_argument("--mib", type=int, default=512, help="memory the cold copies fill")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not native_linear.available():
        sys.exit("native kernels unavailable here")
    print(f"threads={a.threads}  {'type':5} {'N x K':>11} {'kernel':6} {'hot us':>8} {'GB/s':>6} {'cold us':>8} "
          f"{'GB/s':>6}")
    for name in a.types.split(","):
        qtype = int(gguf.GGMLQuantizationType[name])
        kernels = {"exact": native_linear.gemv}
        if qtype in native_linear.Q8X_TYPES and native_linear.has_vnni():
            kernels["int8"] = native_linear.gemv_q8x
        for n, k in SHAPES:
            if n == 49152 and qtype != ggml.Q8_0:
                continue  # the vocab head is Q8_0 in every class file
            blocks = random_blocks(gguf.GGMLQuantizationType[name], n, k, 0)
            cold = [blocks.clone() for _ in range(max(2, (a.mib << 20) // blocks.numel()))]
            x = torch.randn(1, k)
            calls = max(20, int(2e8 // (n * k)))
            times = {(kn, w): [] for kn in kernels for w in ("hot", "cold")}
            for _ in range(a.rounds):
                for kn, fn in kernels.items():
                    times[(kn, "hot")].append(per_call([blocks], qtype, (n, k), x, calls, fn))
                    times[(kn, "cold")].append(per_call(cold, qtype, (n, k), x, calls, fn))
            for kn in kernels:
                h, c = statistics.median(times[(kn, "hot")]), statistics.median(times[(kn, "cold")])
                print(f"{'':10} {name:5} {n:>5}x{k:<5} {kn:6} {h * 1e6:8.1f} {blocks.numel() / h / 1e9:6.1f} "
                      f"{c * 1e6:8.1f} {blocks.numel() / c / 1e9:6.1f}", flush=True)


if __name__ == "__main__":
    main()
