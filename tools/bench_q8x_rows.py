"""How the CPU's int8-activation GEMV (inferflow/native/gemv_q8x.h, the default model's decode kernel where the CPU
has AVX512-VNNI) scales with the activation rows M: a speculative verification is k + 1 rows, a small batch M.

    PYTHONPATH=. python tools/bench_q8x_rows.py [--m 1,4,5,6,8] [--type q4_1] [--shape 3072,576] [--rounds 9]

Per round every M runs in turn (interleaved: the VM's speed drifts), each over 48 copies of the weight cycled (more
bytes than the caches: a decode step reads its weights from memory). Prints the median us per call per M and its
ratio to M = 1. No timing is asserted anywhere.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from inferflow.quant import formats, ggml, native_linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="1,4,5,6,8")
    ap.add_argument("--type", default="q4_1", choices=["q4_0", "q4_1", "q8_0"])
    ap.add_argument("--shape", default="3072,576", help="N,K: the default model's fused gate|up")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not native_linear.has_vnni():
        raise SystemExit("this build or CPU has no AVX512-VNNI int8-activation kernel")
    n, k = map(int, a.shape.split(","))
    qt = getattr(ggml, a.type.upper())
    ws = [formats.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(i)), a.type).data
          for i in range(48)]
    rows = [int(m) for m in a.m.split(",")]
    xs = {m: torch.randn(m, k) for m in rows}
    us: dict[int, list[float]] = {m: [] for m in rows}
    for _ in range(a.rounds):
        for m in rows:
            t = time.perf_counter()
            for w in ws:
                native_linear.gemv_q8x(w, qt, (n, k), xs[m])
            us[m].append((time.perf_counter() - t) / len(ws) * 1e6)
    base = statistics.median(us[rows[0]])
    for m in rows:
        med = statistics.median(us[m])
        print(f"M = {m}: {med:.0f} us per call, {med / base:.2f}x M = {rows[0]}", flush=True)


if __name__ == "__main__":
    main()
