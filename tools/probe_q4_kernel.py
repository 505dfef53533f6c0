"""Run chosen CUDA 4-bit kernel configs a few times on one Qwen3-8B shape, for a profiler to look at.

    ncu --clock-control none --kernel-name regex:q4_mma_rows --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats python3 tools/probe_q4_kernel.py --shape gate_up --rows 64 --kernel rows --configs 0,1
    ncu --clock-control none --kernel-name regex:q4_wgmma --section SpeedOfLight --section MemoryWorkloadAnalysis \
        python3 tools/probe_q4_kernel.py --shape gate_up --rows 128 --kernel wg --configs 3,6   # Hopper's wgmma GEMM

Random Q4_0 blocks and bf16 activations; each config is called ``--calls`` times (eagerly: one kernel launch per
call, which is what ncu profiles). Prints nothing but progress: the numbers are the profiler's.
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_q4_cuda_gpu import SHAPES, q4_0_blocks  # noqa: E402

from inferflow.quant import cuda_q4, triton_kernels, triton_soa  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="gate_up", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--kernel", default="rows", choices=["fma", "mma", "rows", "wg"])
    ap.add_argument("--configs", default="0")
    ap.add_argument("--calls", type=int, default=2)
    a = ap.parse_args()
    n, k = SHAPES[a.shape]
    blocks = q4_0_blocks(n, k)
    codes, scales = triton_soa.soa(blocks, "q4_0", (n, k))
    tab = triton_kernels._scale_table(torch.device("cuda"))
    x = torch.randn(a.rows, k, device="cuda").bfloat16()
    y = torch.empty(a.rows, n, device="cuda", dtype=torch.bfloat16)
    for cfg in (int(c) for c in a.configs.split(",")):
        for _ in range(a.calls):
            cuda_q4.run((a.kernel, cfg), x, blocks, codes, scales, tab, "q4_0", n, k, None, y)
        torch.cuda.synchronize()
        print(f"{a.shape} M={a.rows} {a.kernel} config {cfg}: {a.calls} calls", flush=True)


if __name__ == "__main__":
    main()
