"""Triton dequant-fused matmuls on a CUDA GPU (inferflow/quant/triton_kernels.py): correctness, then speed.

    python tools/bench_triton_quant.py [--rounds 50] [--batches 1,16,64] [--check-only]
    TRITON_INTERPRET=1 python tools/bench_triton_quant.py --interpret    # correctness only, on a CPU, small shapes

1. Check: for every layout the kernels read (inferflow q4, q8 / Q8_0, Q4_0) and Qwen3-8B-like shapes, the kernel's
   output against ``F.linear(x, W)`` with W dequantized by the torch reference decoders, in float32 (IEEE dots) and
   in bf16; prints max|y - ref| / max|ref|. Bounds: 1e-4 (float32: summation order only), 2e-2 (bf16 activations,
   the reference also in bf16). Any miss is printed as FAIL and the script exits 1.
2. Speed at batch rows M (default 1, 16, 64): the kernel (bf16 activations) against torch.matmul with the bf16
   weight (cuBLAS) and against "dequantize then matmul" (the torch decoder into bf16 each call). Kernel and cuBLAS
   are timed as CUDA-graph replays over copies of the weight (>= 256 MB in all, so reads come from HBM, not L2),
   as an engine decode step runs them (--timer events: triton.testing.do_bench per launch, which for kernels of a
   few microseconds measures the host's launch cost: seen on an H200); "deq+mm" with do_bench; effective GB/s counts the bytes of the packed weight (kernel) or of the bf16
   weight (cuBLAS). Shapes (K in -> N out), Qwen3-8B: 4096 -> 6144 (fused q/k/v), 4096 -> 4096 (o), 4096 -> 24576
   (fused gate/up), 12288 -> 4096 (down), 4096 -> 151936 (vocabulary head); --formats picks the formats timed.

No input is read; the exit status is 0 when every check passes, 1 on a mismatch, 2 when no GPU (and no --interpret).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (4096, 151936)]  # (K, N): W is [N, K]
SMALL_SHAPES = [(96, 80), (256, 48)]                      # --interpret
FORMATS = ("q4", "q8", "q4_0")                            # q8 writes Q8_0 blocks (q8_0 is the same layout)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def check(shapes, device: str, batches, names=FORMATS) -> bool:
    from inferflow.quant import formats, triton_kernels

    ok = True
    print(f"\n## 1. kernel vs torch-dequantized reference ({device})")
    print(f"  {'format':6s} {'K':>6s} {'N':>6s} {'M':>4s} {'dtype':9s} {'max rel err':>12s}  result")
    for name in names:
        for k, n in shapes:
            g = torch.Generator().manual_seed(k + n)
            w = torch.randn(n, k, generator=g) * 0.02
            p = formats.quantize(w.to(device), name)  # quantized where it runs (the GPU: seconds, not minutes)
            wd = p.dequantize(torch.float32)
            if not triton_kernels.supports(p.qtype, p.shape, device):
                print(f"  {name:6s} {k:6d} {n:6d}  not supported here: FAIL")
                ok = False
                continue
            for m in batches:
                x = torch.randn(m, k, generator=g).to(device)
                for dt in (torch.float32, torch.bfloat16):
                    xs = x.to(dt)
                    ref = F.linear(xs, wd.to(dt)) if dt != torch.float32 else F.linear(xs, wd)
                    y = triton_kernels.matmul(xs, p.data, p.qtype, p.shape)
                    e = rel(y, ref)
                    good = e <= TOL[dt] and y.dtype == dt and y.shape == ref.shape
                    ok &= good
                    print(f"  {name:6s} {k:6d} {n:6d} {m:4d} {str(dt)[6:]:9s} {e:12.2e}  {'ok' if good else 'FAIL'}")
    return ok


ROTATE_BYTES = 256e6  # graph timer: each call reads another copy of the weight until this many bytes (> L2)


def graph_ms(calls, replays: int) -> float:
    """GPU ms per call of ``calls`` (run in order, each once per replay) timed as CUDA-graph replays: no host
    launch cost in the number (a decode step runs as one graph), and copies of the weight rotated past L2."""
    for c in calls:  # autotuning and first-use work happen outside the capture
        c()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # once more on the capture stream (per-stream buffers are made here)
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(replays):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / replays / len(calls)


def speed(shapes, batches, rounds: int, names=("q4", "q8"), timer: str = "graph") -> None:
    import triton.testing

    from inferflow.quant import formats, triton_kernels

    dev = "cuda"
    how = ("CUDA-graph replays, weight copies rotated past L2" if timer == "graph" else
           f"median, triton.testing.do_bench, {rounds} ms")
    print(f"\n## 2. speed on {torch.cuda.get_device_name()} (ms per call: {how}; bf16 activations)")
    print("  kernel: " + ("weights repacked once (quant/triton_soa.py); 4-bit: FMA GEMV for M <= 2, dequant-fused "
                          "tl.dot GEMM up to 256 rows (quant/triton_q4*.py)" if triton_kernels.SOA else
                          "block-reading kernels (INFERFLOW_TRITON_SOA=0)"))
    print(f"  {'format':6s} {'K':>6s} {'N':>6s} {'M':>4s} {'kernel ms':>10s} {'bf16 mm ms':>11s} {'deq+mm ms':>10s} "
          f"{'kernel/bf16':>11s} {'kernel GB/s':>11s} {'bf16 GB/s':>10s}")
    for name in names:
        for k, n in shapes:
            w = (torch.randn(n, k, device=dev) * 0.02)
            p = formats.quantize(w, name)
            wb = p.dequantize(torch.bfloat16)
            del w
            rk = max(1, min(16, int(-(-ROTATE_BYTES // p.nbytes))))
            rb = max(1, min(16, int(-(-ROTATE_BYTES // (wb.numel() * 2)))))
            blocks = [p.data] + [p.data.clone() for _ in range(rk - 1)] if timer == "graph" else [p.data]
            wbs = [wb] + [wb.clone() for _ in range(rb - 1)] if timer == "graph" else [wb]
            for m in batches:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                fks = [lambda d=d: triton_kernels.matmul(x, d, p.qtype, p.shape) for d in blocks]
                fbs = [lambda v=v: torch.matmul(x, v.t()) for v in wbs]
                fd = lambda: torch.matmul(x, p.dequantize(torch.bfloat16).t())  # noqa: E731
                if timer == "graph":
                    tk, tb = graph_ms(fks, rounds), graph_ms(fbs, rounds)
                else:
                    tk = triton.testing.do_bench(fks[0], rep=rounds, return_mode="median")
                    tb = triton.testing.do_bench(fbs[0], rep=rounds, return_mode="median")
                td = triton.testing.do_bench(fd, rep=rounds, return_mode="median")
                print(f"  {name:6s} {k:6d} {n:6d} {m:4d} {tk:10.4f} {tb:11.4f} {td:10.4f} {tk / tb:10.2f}x "
                      f"{p.nbytes / tk / 1e6:11.0f} {wb.numel() * 2 / tb / 1e6:10.0f}")
            del blocks, wbs
    if triton_kernels.SOA:  # the configs the autotuner picked, per (N, K, rows bucket, layout[, IEEE]) key
        from inferflow.quant import triton_gemv, triton_q4, triton_q4_gemm

        for kern in (triton_gemv.gemv_fma, triton_gemv.gemv_dot, triton_q4.gemv4, triton_q4_gemm.gemm4):
            for key, cfg in getattr(kern, "cache", {}).items():
                print(f"  autotune {getattr(kern.fn, '__name__', '?')} key {key[:4]}: {cfg}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=50, help="do_bench rep (ms of repetitions per measurement)")
    ap.add_argument("--batches", default="1,16,64", help="activation rows M to check and time")
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--no-check", action="store_true", help="timings only")
    ap.add_argument("--formats", default="q4,q8", help="formats to time (check: q4, q8, q4_0 unless --check-formats)")
    ap.add_argument("--check-formats", default=",".join(FORMATS))
    ap.add_argument("--timer", choices=("graph", "events"), default="graph",
                    help="graph: CUDA-graph replays (--rounds replays), rotating weight copies; events: do_bench")
    ap.add_argument("--shapes", default="", help="K:N,... (default: the Qwen3-8B shapes above)")
    ap.add_argument("--interpret", action="store_true",
                    help="no GPU: check the kernels under TRITON_INTERPRET=1 on the CPU, small shapes")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",") if b]
    if a.interpret:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--interpret needs TRITON_INTERPRET=1 in the environment (set before triton loads)")
            return 2
        ok = check(SMALL_SHAPES, "cpu", [1, 3, 20])
        print("\nALL CHECKS PASSED" if ok else "\nSOME CHECKS FAILED")
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or with TRITON_INTERPRET=1 ... --interpret for a CPU check")
        return 2
    from inferflow.quant import triton_kernels

    if not triton_kernels.available():
        print("triton does not import: pip install triton")
        return 2
    print(f"torch {torch.__version__}, triton {__import__('triton').__version__}, {torch.cuda.get_device_name()}")
    shapes = [tuple(int(v) for v in kn.split(":")) for kn in a.shapes.split(",") if kn] or SHAPES
    ok = a.no_check or check(shapes, "cuda", batches, [f for f in a.check_formats.split(",") if f])
    if not a.check_only:
        speed(shapes, batches, a.rounds, [f for f in a.formats.split(",") if f], a.timer)
    print("\nALL CHECKS PASSED" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
