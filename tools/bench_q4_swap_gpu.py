"""The swapped 4-bit GEMM (quant/triton_q4_swap.py, ``y^T = W x^T`` on the warpgroup MMA) per launch config,
against Triton's gemm4, the best CUDA tensor-core config and cuBLAS on the bf16 weight, on Qwen3-8B shapes.

    python3 tools/bench_q4_swap_gpu.py [--shapes qkv,o,gate_up,down] [--rows 16,32,64,128] [--kinds q4_0,q4c]

Each config is first checked against the float32 product with the exactly decoded weight (relative to the largest
output; the limit is the bf16 output's rounding, 8e-3), then timed: in-graph microseconds per call with L2
flushed between calls (triton_q4._flushed_graph_ms, as the autotuners time), medians of 3. The PTX of each config
is searched for ``wgmma``: whether Triton put the dot on the warpgroup MMA.
"""
import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inferflow.quant import cuda_q4, formats, triton_kernels, triton_q4, triton_q4_gemm  # noqa: E402
from inferflow.quant import triton_q4_swap as t4s  # noqa: E402
from inferflow.quant import triton_soa  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_q4_cuda_gpu import SHAPES, candidates, label, q4_0_blocks  # noqa: E402


def _us(fn) -> float:
    fn()
    return statistics.median(triton_q4._flushed_graph_ms(fn) for _ in range(3)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--rows", default="16,32,64,128")
    ap.add_argument("--kinds", default="q4_0")
    ap.add_argument("--no-cuda", action="store_true", help="skip the CUDA kernels' configs")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    tab = triton_kernels._scale_table(torch.device("cuda"))
    ws, cnt = t4s._split_buffers(torch.device("cuda"))
    failed = 0
    for kind in a.kinds.split(","):
        for name in a.shapes.split(","):
            n, k = SHAPES[name]
            if kind == "q4_0":
                blocks = q4_0_blocks(n, k)
            else:
                blocks = formats.quantize(torch.randn(n, k, device="cuda") * 0.02, formats.get("q4")).data
                blocks = blocks.reshape(n, -1)
            codes, scales = triton_soa.soa(blocks, kind, (n, k))
            w = triton_soa.dequantize(codes, scales, tab, kind, (n, k), torch.float32, False)
            mb_bytes = (codes.numel() * 4 + scales.numel() * 2) / 1e6
            code = triton_soa._CODE[kind]
            for m in (int(r) for r in a.rows.split(",")):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                ref = x.float() @ w.t()
                top = ref.abs().max().item()
                bm, mb = t4s.tile_rows(m), 1 << (m - 1).bit_length()
                res = []
                for cfg in t4s._prune(t4s.gemm4s.configs, {"N": n, "KW": codes.shape[1], "MB": mb}):
                    kw = cfg.kwargs

                    def swap(kw=kw, cfg=cfg):
                        return t4s._gemm4s[(-(-n // kw["BLOCK_N"]), -(-m // bm), kw["SPLIT"])](
                            x, codes, scales, tab, y, y, ws, cnt, m, n, k, codes.shape[1], x.stride(0), y.stride(0),
                            mb, HAS_BIAS=False, KIND=code, IEEE=False, BLOCK_M=bm, EVEN=k % 256 == 0, **kw,
                            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
                    try:
                        compiled = swap()
                    except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
                        print(f"  {name} M={m} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    err = (y.float() - ref).abs().max().item() / top
                    wg = compiled.asm.get("ptx", "").count("wgmma.mma_async") if hasattr(compiled, "asm") else -1
                    tag = (f"swap BN={kw['BLOCK_N']},w={cfg.num_warps},st={cfg.num_stages},S={kw['SPLIT']}"
                           f"{'' if wg else ',no-wgmma'}")
                    if err > 8e-3:
                        failed += 1
                        print(f"  {name} M={m} {tag}: max rel err {err:.2e} FAILED", flush=True)
                        continue
                    res.append((tag, _us(swap)))

                def g4():
                    triton_q4_gemm.gemm4[lambda meta: (-(-n // meta["BLOCK_N"]), -(-m // meta["BLOCK_M"]))](
                        x, codes, scales, tab, y, y, m, n, k, codes.shape[1], x.stride(0), y.stride(0), mb,
                        HAS_BIAS=False, KIND=code, IEEE=False)
                others = [("gemm4", _us(g4))]
                rows = min(m, triton_soa.CUDA_MAX_ROWS)
                if not a.no_cuda and kind == "q4_0":  # past 64 rows: the best 64-row config, once per 64 rows
                    cuda = []
                    for cand in candidates(x[:rows], kind, k):
                        def cu(cand=cand):
                            for r in range(0, m, rows):
                                cuda_q4.run(cand, x[r:r + rows], blocks, codes, scales, tab, kind, n, k, None,
                                            y[r:r + rows])
                        cuda.append((label(cand) + ("" if m == rows else f" x{-(-m // rows)}"), _us(cu)))
                    if cuda:
                        others.append(min(cuda, key=lambda r: r[1]))

                def deq():  # the prefill path: the weight decoded into a reused buffer, one cuBLAS matmul
                    wd = triton_soa.dequantize(codes, scales, tab, kind, (n, k), x.dtype, False)
                    torch.mm(x, wd.t(), out=y)
                others.append(("decode+cublas", _us(deq)))

                def mm(dense=torch.randn(n, k, device="cuda", dtype=torch.bfloat16)):
                    torch.mm(x, dense.t(), out=y)
                others.append(("cublas", _us(mm)))
                del mm
                res.sort(key=lambda r: r[1])
                best = res[0] if res else ("none", float("nan"))
                print(f"{kind} {name} {n}x{k} M={m}: swap best {best[1]:.1f} ({best[0]}, {mb_bytes / best[1]:.2f} "
                      f"TB/s)  " + "  ".join(f"{lbl} {t:.1f}" for lbl, t in others), flush=True)
                print("    swap configs: " + ", ".join(f"{lbl[5:]} {t:.1f}" for lbl, t in res), flush=True)
    print(f"checks failed: {failed}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
