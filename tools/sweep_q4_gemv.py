"""Sweep launch configs of the 4-bit GPU GEMV (triton_q4.gemv4) on Qwen3-8B shapes: one row, random q4_0 blocks.

    python3 tools/sweep_q4_gemv.py [--shapes o,gate_up,head] [--split-max-n 16384]

It runs every combination of rows per program (16, 32), groups per step (1, 2), warps (2, 4), the kernel's own
prefetch on or off, split-K (1, 4, 8, where the workspace allows) and software-pipeline stages (1, 3, without the
prefetch). Each is timed in CUDA graphs with L2 flushed between calls, cycling through copies of the weight
(>= 256 MB). Prints the five fastest per shape, and the autotuner's first config. ``--shapes`` picks from qkv, o,
gate_up, down, head; ``--split-max-n`` widens the outputs split-K may take (its workspace is sized by it).
"""
import argparse
import itertools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inferflow.quant import triton_kernels, triton_q4, triton_soa  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--shapes", default="o,gate_up,head")
ap.add_argument("--split-max-n", type=int, default=triton_q4.SPLIT_MAX_N)
a = ap.parse_args()
triton_q4.SPLIT_MAX_N = a.split_max_n  # before the workspace is made
dev = "cuda"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "head": (151936, 4096)}
for name, (n, k) in ((s, SHAPES[s]) for s in a.shapes.split(",")):
    nb = k // 32
    blocks = torch.randint(0, 256, (n, nb, 18), dtype=torch.uint8, device=dev)
    blocks[:, :, :2] = (torch.rand(n, nb, device=dev) * 0.004 + 0.001).half().view(torch.uint8).reshape(n, nb, 2)
    blocks = blocks.reshape(n, nb * 18)
    copies = [blocks] + [blocks.clone() for _ in range(max(1, (256 << 20) // blocks.numel()))]
    packs = [triton_soa.soa(c, "q4_0", (n, k)) for c in copies]
    x = torch.randn(1, k, device=dev).bfloat16()
    y = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
    ws, cnt = triton_soa._split_buffers(x.device)
    tab = triton_kernels._scale_table(x.device)
    kw = packs[0][0].shape[1]
    res = []
    for bn, bg, w, pf, sk, st in itertools.product((16, 32), (1, 2), (2, 4), (True, False), (1, 4, 8), (1, 3)):
        if pf and st > 1:
            continue
        if sk > 1 and (n > triton_q4.SPLIT_MAX_N or kw // 32 < 2 * sk * bg):
            continue
        i = [0]

        def call():
            i[0] = (i[0] + 1) % len(packs)
            c, s = packs[i[0]]
            triton_q4.gemv4.fn.fn[(-(-n // bn), sk)](
                x, c, s, tab, y, y, ws, cnt, n, k, kw, x.stride(0), y.stride(0), HAS_BIAS=False, KIND=2, MP=1,
                BLOCK_N=bn, BG=bg, PREFETCH=pf, SPLIT=sk, EVEN=k % (256 * bg * sk) == 0, num_warps=w, num_stages=st)
        try:
            call()
            t = statistics.median(triton_q4._flushed_graph_ms(call) for _ in range(2)) * 1e3
        except Exception as e:  # noqa: BLE001
            print(name, bn, bg, w, pf, sk, st, "failed", type(e).__name__, str(e)[:100], flush=True)
            continue
        res.append((t, bn, bg, w, pf, sk, st))
    res.sort()
    gb = blocks.numel() / 1e6
    print(f"{name} {n}x{k}: best of {len(res)}", flush=True)
    for t, *cfg in res[:5]:
        print(f"   {t:7.1f} us {gb / t:5.2f} TB/s  BN,BG,warps,prefetch,split,stages = {cfg}", flush=True)
    for t, *cfg in res:
        if cfg == [16, 1, 2, True, 1, 1]:
            print(f"   first config {t:7.1f} us {gb / t:5.2f} TB/s {cfg}")
