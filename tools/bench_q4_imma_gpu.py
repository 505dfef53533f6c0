"""EXPERIMENT: the int8 tensor-core Q4_0 GEMV (inferflow/native/q4_imma.cu) against the bf16 one (q4_mma.cu) on
Qwen3-8B shapes, on a GPU.

Activations are quantized per 32-column block to int8 here in torch (in an engine a producer kernel would write
them). Checks the kernel against the float64 sum of the same integers (exactness of the kernel), and reports the
error of int8 activations against the bf16 product (the arithmetic's cost). Times both kernels' launch configs as
CUDA-graph replays with L2 flushed (``triton_q4._flushed_graph_ms``)::

    python3 tools/bench_q4_imma_gpu.py --rows 1,2
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferflow.native import cuda  # noqa: E402
from inferflow.quant import cuda_q4, cuda_q4_mma  # noqa: E402
from inferflow.quant.triton_q4 import _flushed_graph_ms  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "head": (151936, 4096)}
CONFIGS = ((4, 2), (8, 2), (8, 1), (16, 1), (16, 2), (12, 1))
_P, _I = ctypes.c_void_p, ctypes.c_int


def codes_of(blocks: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[N, K] uint8 codes 0..15 of Q4_0 blocks (byte j: element j low, element j + 16 high)."""
    qs = blocks.view(n, k // 32, 18)[:, :, 2:]
    return torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)


def repack_imma(q: torch.Tensor) -> torch.Tensor:
    """int32 [row tiles, column tiles, 32, 4] in q4_imma.cu's layout from codes [N, K]."""
    n, k = q.shape
    rt, kt = n // 16, k // 64
    v = (q ^ 8).view(rt, 16, kt, 64).permute(0, 2, 1, 3)  # [rt, kt, 16, 64]
    lane = torch.arange(32, device=q.device).view(32, 1, 1)
    wi = torch.arange(4, device=q.device).view(1, 4, 1)
    e = torch.arange(4, device=q.device).view(1, 1, 4)
    g, t, s, h = lane // 4, lane % 4, wi // 2, wi % 2
    col = (32 * s + 16 * h + 4 * t + e).expand(32, 4, 4)
    lo = v[:, :, g.expand(32, 4, 4), col]
    hi = v[:, :, (g + 8).expand(32, 4, 4), col]
    return (lo | (hi << 4)).contiguous().view(torch.int32).view(rt, kt, 32, 4)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 [m, K], float32 dx [m, K / 32], dx / 16) per 32-column block, llama.cpp's q8 rounding."""
    m, k = x.shape
    xb = x.float().view(m, k // 32, 32)
    d = xb.abs().amax(-1) / 127
    x8 = torch.where(d[..., None] > 0, torch.round(xb / d.clamp_min(1e-30)[..., None]), 0).to(torch.int8)
    return x8.view(m, k).contiguous(), d, (d / 16).contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    lib = cuda.load("q4_imma", dev)
    cuda.bind(lib, "q4_imma", [_I, _I, _P, _P, _P, _P, _P, _I, _I, _I, _P], len(CONFIGS))
    mma_lib = cuda_q4._mma_lib(dev)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        nb = k // 32
        blocks = torch.randint(0, 256, (n, nb, 18), dtype=torch.uint8, device=dev)
        blocks[:, :, :2] = (torch.rand(n, nb, device=dev) * 0.004 + 0.001).half().view(torch.uint8).view(n, nb, 2)
        blocks = blocks.view(n, nb * 18)
        q = codes_of(blocks, n, k)
        codes = repack_imma(q)
        mcodes, scales = cuda_q4_mma.repack(blocks, "q4_0", (n, k))
        dw = blocks.view(n, nb, 18)[:, :, :2].contiguous().view(torch.float16).view(n, nb).double()
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            x8, d, d16 = quantize(x)
            y = torch.empty(m, n, device=dev, dtype=torch.float32)
            qm8 = (q.to(torch.int32) - 8).view(n, nb, 32).double()
            isum = torch.einsum("nbj,mbj->mnb", qm8, x8.view(m, nb, 32).double())
            exact = (isum * dw[None] * d.double()[:, None, :]).sum(-1)
            wdec = (qm8 * dw[..., None]).view(n, k)
            ref = x.double() @ wdec.T
            times = {}
            for c in range(len(CONFIGS)):
                def call(c=c):
                    stream = torch.cuda.current_stream(dev).cuda_stream  # the capture's stream when capturing
                    err = lib.q4_imma(0, c, x8.data_ptr(), d16.data_ptr(), codes.data_ptr(), scales.data_ptr(),
                                      y.data_ptr(), n, k // 64, m, ctypes.c_void_p(stream))
                    cuda.check(lib, "q4_imma", err)
                call()
                torch.cuda.synchronize()
                e_exact = ((y.double() - exact).abs().max() / exact.abs().max()).item()
                e_bf16 = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                if c == 0:
                    print(f"{name} {n}x{k} M={m}: vs exact integer sums {e_exact:.2e}, vs the bf16 product "
                          f"{e_bf16:.2e} (int8 activations)")
                if e_exact > 1e-4:
                    print(f"  config {CONFIGS[c]} MISMATCH {e_exact:.2e}")
                    continue
                times[f"imma {CONFIGS[c]}"] = _flushed_graph_ms(call) * 1e3
            yb = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            for c in cuda_q4_mma.gemv_configs(dev):
                times[f"mma {cuda_q4_mma.CONFIGS[c]}"] = _flushed_graph_ms(
                    lambda c=c: cuda_q4_mma.gemv(mma_lib, x, mcodes, scales, n, None, c, yb)) * 1e3
            bi = min((v, kk) for kk, v in times.items() if kk.startswith("imma"))
            bm = min((v, kk) for kk, v in times.items() if kk.startswith("mma"))
            mb = n * k * 4.5 / 8 / 1e6
            print(f"  best imma {bi[1]} {bi[0]:.1f} us ({mb / bi[0]:.2f} TB/s), best mma {bm[1]} {bm[0]:.1f} us "
                  f"({mb / bm[0]:.2f} TB/s): {bm[0] / bi[0]:.2f}x;  all: "
                  + ", ".join(f"{kk} {v:.1f}" for kk, v in times.items()))


if __name__ == "__main__":
    main()
