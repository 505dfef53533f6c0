"""CPU quantized-linear paths of inferflow.quant.cpu_kernels against the ones they replaced, on a real GGUF, with
everything else equal: interleaved rounds in one process, medians and ratios (a shared VM drifts; ratios only).

    PYTHONPATH=. python tools/bench_cpu_quant_paths.py [GGUF] [--threads 2] [--rounds 3] [--tokens 32]

GGUF defaults to the default model (Q4_1 layers + Q8_0 head); the precision-class files
(/tmp/bench9/ladder/*.q4_0.gguf, *.q8_0.gguf) work too. Rows:

- decode: ``Model.generate_ids`` tok/s after a 128-token prompt, the vocab-sized Q8_0 head held "dense" (float32,
  decoded once at load) vs "chunked" (decoded exactly every call, the path before; DENSE_MAX_ELEMS = 0).
- prefill: the same 128-token prompt, int4 layers with the large-M path (W^T decoded once per call into bf16 + one
  GEMM above INT4_MAX_ROWS rows) vs the int4 kernel at every M (INT4_MAX_ROWS = 1e9).
- step linears: every linear of one decode step called back to back at M = 1 (distinct weights: realistic memory
  traffic), through ``cpu_kernels.linear`` vs the bare kernel calls (the wrapper's own cost).
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
from inferflow.quant import cpu_kernels  # noqa: E402
from tools import model_args  # noqa: E402


def med_ms(fns: dict, rounds: int, repeat: int = 1) -> dict[str, float]:
    out = {n: [] for n in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for n, f in fns.items():
            t = time.perf_counter()
            for _ in range(repeat):
                f()
            out[n].append((time.perf_counter() - t) / repeat * 1e3)
    return {n: statistics.median(v) for n, v in out.items()}


def main() -> None:
    def options(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--rounds", type=int, default=3)
        ap.add_argument("--tokens", type=int, default=32)

    a = model_args.parse(__doc__, options, name="gguf")
    dense = inferflow.load(a.gguf)
    saved = cpu_kernels.DENSE_MAX_ELEMS
    cpu_kernels.DENSE_MAX_ELEMS = 0
    try:
        chunked = inferflow.load(a.gguf)
    finally:
        cpu_kernels.DENSE_MAX_ELEMS = saved
    kinds = sorted({k for m in dense.net.modules() for k in (getattr(m, "kernels", None) or {}).values()})
    print(f"{Path(a.gguf).name}: {a.threads} threads, kernels {kinds}")
    ids = list(range(100, 228))
    T = a.tokens

    def decode(m):
        t0 = time.perf_counter()
        m.generate_ids(ids, max_new_tokens=1, stop_ids=set())
        t1 = time.perf_counter()
        m.generate_ids(ids, max_new_tokens=T + 1, stop_ids=set())
        return T / ((time.perf_counter() - t1) - (t1 - t0))

    toks = {"dense head": [], "chunked head": []}
    for _ in range(a.rounds):
        toks["dense head"].append(decode(dense))
        toks["chunked head"].append(decode(chunked))
    d = {n: statistics.median(v) for n, v in toks.items()}
    print(f"decode tok/s: dense head {d['dense head']:.1f}, chunked head {d['chunked head']:.1f}  "
          f"(x{d['dense head'] / d['chunked head']:.2f})")

    max_rows = cpu_kernels.INT4_MAX_ROWS

    def prefill(rows):
        def run():
            cpu_kernels.INT4_MAX_ROWS = rows
            try:
                dense.generate_ids(ids, max_new_tokens=1, stop_ids=set())
            finally:
                cpu_kernels.INT4_MAX_ROWS = max_rows
        return run

    p = med_ms({"large-M": prefill(max_rows), "kernel": prefill(10 ** 9)}, a.rounds)
    print(f"prefill 128 tok/s: large-M path {128e3 / p['large-M']:.0f}, int4 kernel at every M "
          f"{128e3 / p['kernel']:.0f}  (x{p['kernel'] / p['large-M']:.2f})")

    lins = [m for m in dense.net.modules() if (getattr(m, "kernels", None) or {}).get("weight") == "int4"]
    xs = {k: torch.randn(1, k) for k in {m.packed["weight"][1][1] for m in lins}}
    mm = torch.ops.aten._weight_int4pack_mm_for_cpu
    bare = []
    for m in lins:
        k = m.packed["weight"][1][1]
        parts = m.weight_int4.shape[1] * 2 // k
        xb = xs[k].bfloat16().repeat(1, parts)
        bare.append((xb, m.weight_int4, xb.shape[1] // m.weight_int4_sz.shape[0], m.weight_int4_sz))
    s = med_ms({"linear": lambda: [cpu_kernels.linear(m, "weight", xs[m.packed["weight"][1][1]], None)
                                   for m in lins],
                "bare kernel": lambda: [mm(*b) for b in bare]}, max(a.rounds, 5))
    print(f"step linears at M=1 ({len(lins)} int4): cpu_kernels.linear {s['linear']:.2f} ms, bare kernel calls "
          f"{s['bare kernel']:.2f} ms (wrapper x{s['linear'] / s['bare kernel']:.2f})")


if __name__ == "__main__":
    main()
