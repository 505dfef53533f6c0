"""A/B two versions of the native paged decode attention (inferflow/native/cpu_ops.c and its headers), interleaved.

    PYTHONPATH=. python tools/ab_native_attention.py DIR_A DIR_B [--batch 8] [--keys 192] [--layers 30]
                                                    [--dtype float32] [--rounds 9]

DIR_A and DIR_B each hold a full copy of inferflow/native (one with the change). Each ``cpu_ops.c`` is compiled
with the native build's flags against its own headers. Both run the same decode attention: ``--batch``
sequences of ``--keys`` keys, SmolLM2-135M's heads (9 query, 3 kv, 64 dims) and 16-token blocks in shuffled
order. The caches are ``--layers`` separate ones, called in turn, as a decode step reads its cache from memory.
The outputs must be equal bit for bit. Prints ms per ``--layers`` calls and B's time over A's (medians of
alternating rounds).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.native import FLAGS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--keys", type=int, default=192)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tmp = tempfile.mkdtemp(prefix="ab-att-")
    fns = []
    for i, d in enumerate((a.a, a.b)):
        out = f"{tmp}/v{i}.so"
        subprocess.run(["cc", *FLAGS, f"-I{d}", "-o", out, str(Path(d) / "cpu_ops.c"), "-lm"], check=True)
        fns.append(ctypes.CDLL(out).cpu_paged_decode)
    dt = getattr(torch, a.dtype)
    code = {torch.float32: 0, torch.bfloat16: 1}[dt]
    B, H, hkv, D, bs = a.batch, 9, 3, 64, 16
    per = -(-a.keys // bs)
    nb = B * per
    g = torch.Generator().manual_seed(0)
    tables = torch.randperm(nb, generator=g).view(B, per).contiguous()
    lens = torch.full((B,), a.keys, dtype=torch.int64)
    caches = [(torch.randn(nb * bs, hkv, D, generator=g).to(dt), torch.randn(nb * bs, hkv, D, generator=g).to(dt))
              for _ in range(a.layers)]
    q = torch.randn(B, H, D, generator=g).to(dt)
    outs = [torch.empty(B, H, D, dtype=dt) for _ in fns]
    p = ctypes.c_void_p
    i64 = ctypes.c_int64

    def run(i: int) -> None:
        for kc, vc in caches:
            fns[i](code, code, p(q.data_ptr()), i64(H * D), None, i64(0), None, i64(0), p(kc.data_ptr()),
                   p(vc.data_ptr()), None, p(tables.data_ptr()), i64(per), p(lens.data_ptr()), i64(B), i64(H),
                   i64(hkv), i64(D), i64(bs), ctypes.c_float(D ** -0.5), i64(0), p(outs[i].data_ptr()), a.threads)

    times: list[list[float]] = [[], []]
    for r in range(a.rounds):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            t0 = time.perf_counter()
            run(i)
            times[i].append(time.perf_counter() - t0)
    if not torch.equal(outs[0], outs[1]):
        print(f"outputs differ (max {(outs[0].float() - outs[1].float()).abs().max():.3g})")
    ta, tb = (statistics.median(t) * 1e3 for t in times)
    kv = 2 * B * a.keys * hkv * D * q.element_size() * a.layers
    print(f"batch {B}, {a.keys} keys, {a.layers} layers, {a.dtype}: A {ta:.2f} ms ({kv / ta / 1e6:.1f} GB/s of K/V)  "
          f"B {tb:.2f} ms ({kv / tb / 1e6:.1f} GB/s)  B/A {tb / ta:.3f}")


if __name__ == "__main__":
    main()
