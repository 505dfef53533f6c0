"""A/B two versions of the float GEMV source (inferflow/native/gemv_float.c), interleaved in one process.

    PYTHONPATH=. python tools/ab_native_gemv.py A.c B.c [--shape 3072,576] [--dtype float32] [--rows 1,4,8]
                                               [--copies 40] [--rounds 9] [--huge]

Each file is compiled with the native build's flags (headers from inferflow/native) into its own library. Both
run the same calls on ``--copies`` copies of one random weight, cycled so that each call streams its weight from
memory, as a decode step does. ``--huge`` puts the copies in huge pages. The outputs must be equal bit for bit.
Prints us per call, GB/s of weight read, and B's time over A's (medians of ``--rounds`` alternating rounds).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inferflow.model import hugepages  # noqa: E402
from inferflow.native import FLAGS  # noqa: E402

NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--shape", default="3072,576")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--copies", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--huge", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    n, k = (int(v) for v in a.shape.split(","))
    dt = getattr(torch, a.dtype)
    tmp = tempfile.mkdtemp(prefix="ab-gemv-")
    fns = []
    for i, src in enumerate((a.a, a.b)):
        out = f"{tmp}/v{i}.so"
        subprocess.run(["cc", *FLAGS, f"-I{ROOT / 'inferflow' / 'native'}", "-o", out, src, "-lm"], check=True)
        fns.append(getattr(ctypes.CDLL(out), f"inferflow_gemv_{NAMES[dt]}"))
    w0 = torch.randn(n, k).to(dt)
    nb = w0.numel() * w0.element_size()
    if a.huge:
        arena = hugepages.empty_bytes(nb * a.copies)
        ws = [arena[i * nb:(i + 1) * nb].view(dt).view(n, k) for i in range(a.copies)]
        for w in ws:
            w.copy_(w0)
    else:
        ws = [w0.clone() for _ in range(a.copies)]
    p = ctypes.c_void_p
    for m in (int(r) for r in a.rows.split(",")):
        x = torch.randn(m, k).to(dt)
        ys = [torch.empty(m, n, dtype=dt) for _ in fns]
        times: list[list[float]] = [[], []]
        for r in range(a.rounds):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                reps = max(1, 60 // a.copies)
                t0 = time.perf_counter()
                for _ in range(reps):
                    for w in ws:
                        fns[i](p(x.data_ptr()), ctypes.c_int64(k), p(w.data_ptr()), None, p(ys[i].data_ptr()),
                               ctypes.c_int64(m), ctypes.c_int64(n), ctypes.c_int64(k), a.threads)
                times[i].append((time.perf_counter() - t0) / (reps * a.copies))
        if not torch.equal(ys[0], ys[1]):
            print(f"M={m}: outputs differ (max {(ys[0].float() - ys[1].float()).abs().max():.3g})")
        ta, tb = (statistics.median(t) for t in times)
        print(f"M={m:2d}  A {ta * 1e6:8.1f} us {nb / ta / 1e9:5.1f} GB/s   B {tb * 1e6:8.1f} us "
              f"{nb / tb / 1e9:5.1f} GB/s   B/A {tb / ta:.3f}")


if __name__ == "__main__":
    main()
