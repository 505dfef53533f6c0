"""Native float GEMV (inferflow/native/gemv_float.c) vs torch's ops on the default model's decode shapes.

Per shape, dtype and row count the systems run interleaved (A, B, C, A, B, C, ...: a busy machine slows them all
alike), each round timing a burst of calls; the medians over rounds are printed as us/call, weight GB/s, and the
ratio torch / native (> 1: native is faster).

    PYTHONPATH=. python tools/bench_native_gemv.py --threads 2 --rounds 15
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from inferflow.native import float_linear

# (in_features K, out_features N) of SmolLM2-135M: o_proj, fused q|k|v, fused gate|up, down_proj, vocabulary head
SHAPES = [(576, 576), (576, 960), (576, 3072), (1536, 576), (576, 49152)]
COLD_BYTES = 320 << 20  # weight copies cycled per system: more than the caches (L3 can be ~300 MiB)
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def _cycled(make, ws: list[torch.Tensor]):
    """A call on the next weight copy at each call: a decode step reads each weight once, from memory, not from a
    cache still warm from the previous call."""
    fns = [make(w) for w in ws]
    state = [0]

    def call():
        i = state[0] = (state[0] + 1) % len(fns)
        return fns[i]()
    return call


def _systems(x: torch.Tensor, ws: list[torch.Tensor]) -> dict[str, callable]:
    out = {"native": _cycled(lambda w: lambda: float_linear.linear(x, w, None), ws),
           "F.linear": _cycled(lambda w: lambda: F.linear(x, w), ws)}
    if ws[0].dtype == torch.bfloat16 and float_linear.amx():
        # the AVX512_BF16 path, for comparison: switched around each burst
        out["no-AMX"] = _cycled(lambda w: lambda: float_linear.linear(x, w, None), ws)
        out["no-AMX"].setup = lambda: float_linear.amx(False)
        out["no-AMX"].teardown = lambda: float_linear.amx(True)
    if x.shape[0] == 1:
        out["torch.mv"] = _cycled(lambda w: lambda: torch.mv(w, x[0]), ws)
    if torch.backends.mkldnn.is_available() and ws[0].dtype != torch.float16:
        try:
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0]) for w in ws]
            lin = torch.ops.mkldnn._linear_pointwise
            lin(x, packed[0], None, "none", [None], "")
            out["oneDNN"] = _cycled(lambda p: lambda: lin(x, p, None, "none", [None], ""), packed)
        except (RuntimeError, AttributeError):
            pass
    return out


def _burst(fn, calls: int) -> float:
    getattr(fn, "setup", lambda: None)()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls
    getattr(fn, "teardown", lambda: None)()
    return t


def bench(k: int, n: int, rows: int, dtype: torch.dtype, rounds: int, budget_s: float,
          stat=statistics.median) -> dict[str, float]:
    torch.manual_seed(0)
    w = torch.randn(n, k).to(dtype)
    x = torch.randn(rows, k).to(dtype)
    copies = max(1, -(-COLD_BYTES // (w.numel() * w.element_size())))
    systems = _systems(x, [w] + [w.clone() for _ in range(copies - 1)])
    for fn in systems.values():  # warm: page in, build, pack
        _burst(fn, 1)
    once = _burst(systems["native"], 3)
    calls = max(2, int(budget_s / max(once, 1e-6)))
    times: dict[str, list[float]] = {s: [] for s in systems}
    for _ in range(rounds):
        for name, fn in systems.items():
            times[name].append(_burst(fn, calls))
    return {s: stat(v) for s, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--burst-ms", type=float, default=20.0, help="time per timed burst of calls")
    ap.add_argument("--stat", choices=["median", "min"], default="median",
                    help="over rounds: median (default), or min (an estimate of the unloaded machine's speed)")
    ap.add_argument("--shapes", default=None, help="K x N list, e.g. 576x576,576x49152 (default: the model's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not float_linear.available():
        raise SystemExit("native float kernels unavailable (no compiler, or INFERFLOW_NATIVE=0)")
    print(f"threads={args.threads} rounds={args.rounds} stat={args.stat}; ratio = other / native (> 1: native faster)")
    print(f"{'dtype':5} {'M':>2} {'K x N':>12} {'system':9} {'us/call':>9} {'GB/s':>6} {'ratio':>6}")
    for dname in args.dtypes.split(","):
        dtype = DTYPES[dname]
        for rows in (int(r) for r in args.rows.split(",")):
            shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
            for k, n in shapes:
                med = bench(k, n, rows, dtype, args.rounds, args.burst_ms / 1e3, min if args.stat == "min" else
                            statistics.median)
                gbytes = n * k * torch.finfo(dtype).bits / 8 / 1e9
                for name, t in med.items():
                    print(f"{dname:5} {rows:2} {f'{k}x{n}':>12} {name:9} {t * 1e6:9.1f} {gbytes / t:6.1f} "
                          f"{t / med['native']:6.2f}")


if __name__ == "__main__":
    main()
