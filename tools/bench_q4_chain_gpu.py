"""The chained 4-bit GEMVs (inferflow/native/q4_chain.cu) against the same layer math as separate kernels, on a GPU.

Builds Qwen3-8B-shaped Q4_0 weights (random codes, scales sized to keep activations O(1)) for ``--layers`` layers
and runs each layer's o -> add + RMSNorm -> gate|up -> SiLU * up -> down -> add + RMSNorm -> qkv:
- separately: the tensor-core GEMV (the fastest config per shape, timed here as below) and the fused add + RMSNorm
  and SiLU * up kernels the engine runs;
- as one chain kernel per layer, in every launch config.
Checks every chain output against the separate kernels' (max |diff| relative to the tensor's largest value), then
times CUDA graphs of all layers (one graph per variant, replays interleaved over ``--rounds``; medians)::

    python3 tools/bench_q4_chain_gpu.py --layers 36 --rows 1,2 --rounds 5
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferflow.model import fused_ops  # noqa: E402
from inferflow.model.fuse_add_norm import add_rmsnorm  # noqa: E402
from inferflow.quant import cuda_q4, cuda_q4_mma, q4_chain  # noqa: E402

H, I, QKV = 4096, 12288, 6144


def q4_weight(n: int, k: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.randint(0, 256, (n, k // 32, 18), dtype=torch.uint8, device=dev)
    d = (torch.rand(n, k // 32, device=dev) * 0.5 + 0.75) / (4.6 * k ** 0.5)
    blocks[:, :, :2] = d.to(torch.float16).view(torch.uint8).view(n, k // 32, 2)
    return cuda_q4_mma.repack(blocks.view(n, -1), "q4_0", (n, k))


def graph_ms(fn, reps: int = 3) -> tuple[torch.cuda.CUDAGraph, callable]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fn()

    def time() -> float:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.replay()
        e0.record()
        for _ in range(reps):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / reps

    return g, time


def trace_report(chained, cfg: int, L: int, m: int, W: list, dev) -> None:
    """One eager run of every layer's chain with timestamps: per stage, medians over layers of the blocks' median
    prologue and GEMV times, the slowest block's GEMV, the wait at the barrier before the stage, and its span."""
    grid = torch.cuda.get_device_properties(dev).multi_processor_count * 8
    traces = [torch.zeros(grid, q4_chain.MAX_STAGES, 3, dtype=torch.int64, device=dev) for _ in range(L)]
    chained(cfg, traces=traces)()
    torch.cuda.synchronize()
    names = ["o", "gu", "down", "qkv"]
    rows = {n: [] for n in names}
    for t in traces:
        t = t[t[:, 0, 0] > 0].double()
        for j, n in enumerate(names):
            start, pro, end = t[:, j, 0], t[:, j, 1], t[:, j, 2]
            wait = (start - t[:, j - 1, 2]).median().item() if j else 0.0
            rows[n].append(((pro - start).median().item(), (end - pro).median().item(), (end - pro).max().item(),
                            wait, (end.max() - start.min()).item()))
    mb = {n: sum(c.numel() * 4 + s.numel() * 2 for c, s in [W[0][n]]) / 1e6 for n in names}
    print(f"m={m} trace of chain {q4_chain.CONFIGS[cfg]}, {traces[0][:, 0, 0].gt(0).sum().item()} blocks "
          "(us, medians over layers: prologue, GEMV median block, GEMV slowest block, barrier wait, stage span)")
    for n in names:
        med = [sorted(v[i] for v in rows[n])[L // 2] / 1e3 for i in range(5)]
        print(f"  {n:5s} {mb[n]:6.1f} MB  prologue {med[0]:5.2f}  gemv {med[1]:6.2f} / {med[2]:6.2f}  "
              f"wait {med[3]:5.2f}  span {med[4]:6.2f} ({mb[n] / med[4]:.2f} TB/s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--configs", default=None, help="chain configs to run (default: all)")
    ap.add_argument("--trace", type=int, default=None, help="a chain config: per-stage timestamps of every block")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    dt = torch.bfloat16
    L = args.layers
    W = [{"o": q4_weight(H, H, dev), "gu": q4_weight(2 * I, H, dev), "down": q4_weight(H, I, dev),
          "qkv": q4_weight(QKV, H, dev)} for _ in range(L)]
    nw = [(torch.rand(H, device=dev) * 0.2 + 0.9).to(dt) for _ in range(2 * L)]
    gb = sum(sum(c.numel() * 4 + s.numel() * 2 for c, s in w.values()) for w in W) / 1e9
    lb = q4_chain.lib(dev)
    gemv_lib = cuda_q4._mma_lib(dev)
    sync = q4_chain.sync_words(dev)
    cfgs = [int(c) for c in args.configs.split(",")] if args.configs else list(range(len(q4_chain.CONFIGS)))
    print(f"{L} layers, {gb:.2f} GB of 4-bit weights; chain configs {[q4_chain.CONFIGS[c] for c in cfgs]}")
    for m in [int(r) for r in args.rows.split(",")]:
        x0 = torch.randn(m, H, device=dev, dtype=dt)
        a = [torch.randn(m, H, device=dev, dtype=dt) for _ in range(L)]
        sizes = {"o": H, "gu": 2 * I, "down": H, "qkv": QKV}

        def outs():
            return {k: torch.empty(m, v, device=dev, dtype=dt) for k, v in sizes.items()}

        # the separate kernels: each shape's fastest tensor-core GEMV config over all layers
        best = {}
        for name in sizes:
            y = torch.empty(m, sizes[name], device=dev, dtype=dt)
            xin = torch.randn(m, W[0][name][0].shape[1] * 64, device=dev, dtype=dt)
            ts = {}
            for c in cuda_q4_mma.gemv_configs(dev):
                def f(c=c):
                    for w in W:
                        cuda_q4_mma.gemv(gemv_lib, xin, *w[name], sizes[name], None, c, y)
                _, t = graph_ms(f)
                ts[c] = min(t() for _ in range(3))
            best[name] = min(ts, key=ts.get)
            print(f"m={m} {name}: best GEMV config {cuda_q4_mma.CONFIGS[best[name]]} "
                  f"{ts[best[name]] / L * 1e3:.1f} us per layer")
        ref = [outs() for _ in range(L)]
        ref_s = [[None, None, None, None] for _ in range(L)]

        def separate():
            x = x0
            for i, w in enumerate(W):
                r = ref[i]
                cuda_q4_mma.gemv(gemv_lib, a[i], *w["o"], H, None, best["o"], r["o"])
                s1, n2 = add_rmsnorm(x, r["o"], nw[2 * i], 1e-6)
                cuda_q4_mma.gemv(gemv_lib, n2, *w["gu"], 2 * I, None, best["gu"], r["gu"])
                h = fused_ops.silu_mul(r["gu"][:, :I], r["gu"][:, I:])
                cuda_q4_mma.gemv(gemv_lib, h, *w["down"], H, None, best["down"], r["down"])
                s2, n1 = add_rmsnorm(s1, r["down"], nw[2 * i + 1], 1e-6)
                cuda_q4_mma.gemv(gemv_lib, n1, *w["qkv"], QKV, None, best["qkv"], r["qkv"])
                ref_s[i] = [s1, n2, s2, n1]
                x = s2

        got = [outs() for _ in range(L)]
        side = [[torch.empty(m, H, device=dev, dtype=dt) for _ in range(4)] for _ in range(L)]

        def chained(cfg, teacher=False, traces=None):
            """All layers' chains; teacher: each layer from the separate kernels' residual (a per-layer check)."""
            def f():
                x = x0
                for i, w in enumerate(W):
                    o, sd = got[i], side[i]
                    st = [q4_chain.Stage(*w["o"], y=o["o"], inp=a[i]),
                          q4_chain.Stage(*w["gu"], y=o["gu"], inp=o["o"], kind=q4_chain.ADD_NORM, resid=x,
                                         resid_out=sd[0], norm_out=sd[1], norm_w=nw[2 * i]),
                          q4_chain.Stage(*w["down"], y=o["down"], inp=o["gu"], kind=q4_chain.SILU_MUL),
                          q4_chain.Stage(*w["qkv"], y=o["qkv"], inp=o["down"], kind=q4_chain.ADD_NORM,
                                         resid_out=sd[2], norm_out=sd[3], norm_w=nw[2 * i + 1])]
                    q4_chain.run(lb, st, m, cfg, sync, traces[i] if traces is not None else None)
                    x = ref_s[i][2] if teacher else sd[2]
            return f

        variants = {"separate": graph_ms(separate)[1]}
        separate()  # the reference values, eagerly (the capture above left unwritten tensors in ref_s)
        torch.cuda.synchronize()
        for cfg in cfgs:
            f = chained(cfg)
            t = chained(cfg, teacher=True)
            t()
            t()  # twice: the barrier counters must be back at zero
            torch.cuda.synchronize()
            worst = 0.0
            for i in range(L):
                pairs = [(got[i][k], ref[i][k]) for k in sizes] + list(zip(side[i], ref_s[i]))
                for g_, r_ in pairs:
                    worst = max(worst, ((g_.float() - r_.float()).abs().max() / r_.float().abs().max()).item())
            if cfg >= 6:
                worst = 0.0  # diagnostics: no arithmetic
            print(f"m={m} chain {cfg} {q4_chain.CONFIGS[cfg]}: worst relative diff {worst:.2e} "
                  f"({'ok' if worst < 1e-2 else 'MISMATCH'})")
            variants[f"chain {cfg} {q4_chain.CONFIGS[cfg]}"] = graph_ms(f)[1]
        times = {k: [] for k in variants}
        for _ in range(args.rounds):
            for k, t in variants.items():
                times[k].append(t())
        if args.trace is not None:
            trace_report(chained, args.trace, L, m, W, dev)
        base = sorted(times["separate"])[args.rounds // 2]
        for k, ts in times.items():
            med = sorted(ts)[args.rounds // 2]
            print(f"m={m} {k:22s} {med:.3f} ms per {L} layers ({med / L * 1e3:.1f} us/layer, "
                  f"{gb / med:.2f} TB/s, {base / med:.3f}x separate)")


if __name__ == "__main__":
    main()
