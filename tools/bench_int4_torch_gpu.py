"""PyTorch's own 4-bit GPU matmul (``aten._weight_int4pack_mm``, tinygemm: gpt-fast's and torchao's int4 path) on the
Qwen3-8B decode shapes, to compare against inferflow's 4-bit GEMV (docs/benchmarks.md, tools/sweep_q4_gemv.py).

    python3 tools/bench_int4_torch_gpu.py

Random 4-bit codes packed by ``aten._convert_weight_to_int4pack`` (inner k tiles 8) with bf16 scales and zeros per
group of 32 and of 128 columns, bf16 activations of 1 and 2 rows. Each call is timed in CUDA graphs with L2 flushed
between calls, cycling through copies of the weight (>= 256 MB). TB/s counts the codes and the scales.
"""
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inferflow.quant import triton_q4  # noqa: E402

dev = "cuda"
SH = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288), "head": (151936, 4096)}
for g in (32, 128):
    for name, (n, k) in SH.items():
        q = torch.randint(0, 16, (n, k), dtype=torch.int32, device=dev)
        w8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(w8, 8)
        sz = torch.randn(k // g, n, 2, device=dev).bfloat16() * 0.01
        nbytes = n * k // 2 + sz.numel() * 2
        copies = [(packed, sz)] + [(packed.clone(), sz.clone()) for _ in range(max(1, (256 << 20) // nbytes))]
        for m in (1, 2):
            x = torch.randn(m, k, device=dev).bfloat16()
            torch.ops.aten._weight_int4pack_mm(x, packed, g, sz)
            i = [0]

            def call():
                i[0] = (i[0] + 1) % len(copies)
                p, s = copies[i[0]]
                torch.ops.aten._weight_int4pack_mm(x, p, g, s)
            t = statistics.median(triton_q4._flushed_graph_ms(call) for _ in range(3)) * 1e3
            print(f"group {g} {name:8} {n}x{k} M={m}: {t:7.1f} us {nbytes / t / 1e6:5.2f} TB/s", flush=True)
