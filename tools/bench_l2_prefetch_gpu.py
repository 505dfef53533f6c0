"""Cross-kernel L2 prefetch (quant/l2_prefetch.py) on a decode step's 4-bit matmuls, without a model: a CUDA graph
of L layers of Qwen3-8B-shaped Q4_0 projections (qkv, o, gate/up, down) and the vocabulary head, through the
engine's matmul (``triton_soa.matmul``: the same kernel choices), with small kernels between them where a decode
step has its norms, RoPE and attention. One graph per prefetch setting, all recorded from the same eager run,
replayed in interleaved rounds (these machines change speed within seconds).

    python3 tools/bench_l2_prefetch_gpu.py [--layers 36] [--rows 1,16] [--settings 0,start:24,end:24] [--rounds 5]

A setting is ``0`` (off) or ``MODE:MB`` (``$INFERFLOW_L2_PREFETCH`` and ``$INFERFLOW_L2_PREFETCH_MB`` while its
graph is captured). Prints ms per replay (median of rounds), the ratio to the first setting, and the Q4_0 bytes
read per second.
"""
import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_q4_cuda_gpu import SHAPES, q4_0_blocks  # noqa: E402
from inferflow.quant import l2_prefetch, triton_kernels, triton_soa  # noqa: E402

# small kernels before each projection in a decode layer: add+norm; q/k norm+RoPE+K/V write, attention; add+norm;
# SwiGLU's product
GAPS = {"qkv": 1, "o": 2, "gate_up": 1, "down": 1, "head": 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--settings", default="0,start:24,end:24")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10, help="replays timed per round and setting")
    ap.add_argument("--no-head", action="store_true")
    a = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    tab = triton_kernels._scale_table(dev)
    names = ["qkv", "o", "gate_up", "down"] * a.layers + ([] if a.no_head else ["head"])
    weights = [(name, q4_0_blocks(*SHAPES[name]), SHAPES[name]) for name in names]
    total_mb = sum(b.numel() for _, b, _ in weights) / 1e6
    settings = a.settings.split(",")
    print(f"{a.layers} layers{'' if a.no_head else ' + head'}: {len(weights)} Q4_0 matmuls, {total_mb:.0f} MB",
          flush=True)
    for m in (int(r) for r in a.rows.split(",")):
        xs = {k: torch.randn(m, k, device=dev).to(dtype) for k in (4096, 12288)}
        small = torch.zeros(m, 4096, device=dev, dtype=dtype)

        def step() -> None:
            for name, blocks, (n, k) in weights:
                for _ in range(GAPS[name]):
                    small.add_(1.0)
                triton_soa.matmul(xs[k], blocks, "q4_0", (n, k), tab, None, False)

        step()  # kernel choices timed, layouts made
        with l2_prefetch.recording() as order:
            step()
        torch.cuda.synchronize()
        graphs = {}
        for s in settings:
            setting, pdl = s.split("+pdl")[0], "+pdl" in s
            setting, _, most = setting.partition("<")
            os.environ["INFERFLOW_L2_PREFETCH_MAX_MB"] = most or "1e9"
            mode, _, mb = setting.partition(":")
            os.environ[l2_prefetch.ENV] = mode
            os.environ[l2_prefetch.PDL_ENV] = "1" if pdl else "0"
            if mb:
                os.environ[l2_prefetch.CAP_ENV] = mb
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g), l2_prefetch.capturing(order):
                step()
            graphs[s] = g
        times: dict[str, list[float]] = {s: [] for s in settings}
        for _ in range(a.rounds):
            for s, g in graphs.items():
                g.replay()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(a.reps):
                    g.replay()
                e1.record()
                torch.cuda.synchronize()
                times[s].append(e0.elapsed_time(e1) / a.reps)
        base = statistics.median(times[settings[0]])
        for s in settings:
            ms = statistics.median(times[s])
            print(f"M={m} {s:>10}: {ms:.3f} ms per replay ({base / ms:.3f}x {settings[0]}), "
                  f"{total_mb / ms / 1e3:.2f} TB/s of Q4_0; rounds {' '.join(f'{t:.3f}' for t in times[s])}",
                  flush=True)
        del graphs


if __name__ == "__main__":
    main()
