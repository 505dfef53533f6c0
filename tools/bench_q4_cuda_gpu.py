"""The CUDA 4-bit kernels (native/q4_gemv.cu, q4_mma.cu, q4_mma_rows.cu) against Triton's gemv4 (1-2 rows) or
gemm4 (more) on Qwen3-8B shapes: correctness, then time.

    python3 tools/bench_q4_cuda_gpu.py [--shapes qkv,o,gate_up,down,head] [--rows 1,2,16,64] [--dtype bfloat16]

Checks first: for q4_0 (random blocks) and inferflow q4 (q4c, a quantized random weight), M = 1 to 64, float32
and bf16 activations, with and without a bias, every launch config of every CUDA kernel that takes the operands
against the float64 product with the torch-decoded weight (relative to its largest output), and through
``triton_kernels.matmul`` (the engine's path, which picks a config by timing). Then, per shape: in-graph
microseconds per call with L2 flushed between calls (triton_q4._flushed_graph_ms, as the autotuners time), Triton's
autotuned kernel, each CUDA config and cuBLAS on the bf16 weight, medians of 3, and the weight bytes read per second.
"""
import argparse
import ctypes
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inferflow.quant import (cuda_q4, cuda_q4_mma, formats, ggml, triton_kernels, triton_q4,  # noqa: E402
                             triton_q4_gemm, triton_soa)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "head": (151936, 4096)}


def q4_0_blocks(n: int, k: int) -> torch.Tensor:
    nb = k // 32
    b = torch.randint(0, 256, (n, nb, 18), dtype=torch.uint8, device="cuda")
    b[:, :, :2] = (torch.rand(n, nb, device="cuda") * 0.004 + 0.001).half().view(torch.uint8).reshape(n, nb, 2)
    return b.reshape(n, nb * 18)


def check(engine: bool = True) -> None:
    """Every CUDA config against float64; with ``engine``, also the engine's matmul (which autotunes Triton for
    each new row count: minutes of compiling)."""
    tab = triton_kernels._scale_table(torch.device("cuda"))
    q4 = formats.get("q4")
    shapes = (("q4_0", (1000, 4096)), ("q4_0", (300, 832)), ("q4_0", (200, 960)), ("q4c", (520, 1312)))
    for kind, (n, k) in shapes if engine else shapes[:3]:
        if kind == "q4_0":
            blocks, qtype = q4_0_blocks(n, k), ggml.Q4_0
            w = ggml.dequantize(blocks.cpu(), qtype, (n, k)).double().cuda()
        else:
            p = formats.quantize(torch.randn(n, k) * 0.02, q4)
            blocks, qtype = p.data.reshape(n, -1).cuda(), q4.qtype
            w = p.dequantize().double().cuda()
        codes, scales = triton_soa.soa(blocks, kind, (n, k))
        for dtype in (torch.float32, torch.bfloat16):
            for m in (1, 2, 5, 16, 37, 64, 100, 256):  # beyond 2: the tensor-core kernels only (64: Hopper's)
                for with_bias in (False, True):
                    x = torch.randn(m, k, device="cuda").to(dtype)
                    bias = torch.randn(n, device="cuda").to(dtype) if with_bias else None
                    ref = x.double() @ w.t() + (bias.double() if with_bias else 0)
                    scale = ref.abs().max().item()
                    errs = []
                    out = torch.empty(m, n, device="cuda", dtype=dtype)
                    cands = candidates(x, kind, k)
                    for cand in cands:
                        y = cuda_q4.run(cand, x, blocks, codes, scales, tab, kind, n, k, bias, out)
                        errs.append((y.double() - ref).abs().max().item() / scale)
                    if engine:
                        y = triton_kernels.matmul(x, blocks, qtype, (n, k), bias)
                        errs.append((y.double() - ref).abs().max().item() / scale)
                    if len(errs) == int(engine):
                        continue  # no CUDA kernel takes these rows
                    limit = 1e-5 if dtype == torch.float32 else 8e-3
                    worst = max(errs[:-1] if engine else errs)
                    fold = [e for c, e in zip(cands, errs)
                            if c[0] == "wg" or (c[0] == "rows" and cuda_q4_mma.ROWS_CONFIGS[c[1]][2])]
                    print(f"check {kind} {n}x{k} {str(dtype)[6:]} M={m} bias={with_bias}: max rel err "
                          f"{worst:.2e} (configs){f', {max(fold):.2e} (scale folded)' if fold else ''}"
                          f"{f', {errs[-1]:.2e} (matmul)' if engine else ''}"
                          f"{'' if max(errs) <= limit else '  FAILED'}", flush=True)


def candidates(x: torch.Tensor, kind: str, k: int) -> list[tuple[str, int]]:
    """Every launch config of every CUDA kernel that takes these operands."""
    cands = [("fma", c) for c in range(len(cuda_q4.CONFIGS))] if cuda_q4._fma_supports(x, kind) else []
    if cuda_q4_mma.supports(x, kind, k):
        cands += [("mma", c) for c in cuda_q4_mma.gemv_configs(x.device)]
    if cuda_q4_mma.rows_supports(x, kind, k):
        cands += [("rows", c) for c in range(len(cuda_q4_mma.ROWS_CONFIGS))]
    if cuda_q4_mma.wg_supports(x, kind, k):
        cands += [("wg", c) for c in range(len(cuda_q4_mma.WG_CONFIGS))]
    return cands


def label(cand: tuple[str, int]) -> str:
    if cand[0] == "fma":
        return f"fma R={cuda_q4.CONFIGS[cand[1]]}"
    if cand[0] == "mma":
        w, u, s = cuda_q4_mma.CONFIGS[cand[1]]
        return f"mma W={w},U={u}" + (f",bulk S={s}" if s else "")
    if cand[0] == "wg":
        wg, rw, ks, stages = cuda_q4_mma.WG_CONFIGS[cand[1]]
        return f"wgmma WG={wg},RW={rw},KS={ks},S={stages}"
    r, w, fold, minb = cuda_q4_mma.ROWS_CONFIGS[cand[1]]
    return f"rows R={r},W={w}{',fold' if fold else ''}{f',{minb}/SM' if minb > 1 else ''}"


def _reader():
    """tools/stream_read.cu built for this GPU (None without nvcc)."""
    from inferflow.native import cached_build, cuda

    compiler = cuda.nvcc()
    if compiler is None:
        return None
    src = Path(__file__).with_name("stream_read.cu")
    arch = torch.cuda.get_device_capability()
    lib = ctypes.CDLL(str(cached_build(src, lambda out: cuda.build_command(compiler, src, arch, out), repr(arch))))
    lib.stream_read.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    return lib


def read_ceiling_us(buf: torch.Tensor) -> float | None:
    """In-graph µs (L2 flushed) of the fastest plain read of ``buf``'s bytes: what a GEMV over them could take."""
    lib = _reader()
    if lib is None:
        return None
    out = torch.empty(4096, dtype=torch.int32, device="cuda")
    times = []
    for per_sm in (2, 4, 8):
        def go(per_sm=per_sm):
            stream = torch.cuda.current_stream().cuda_stream
            assert lib.stream_read(buf.data_ptr(), buf.numel(), out.data_ptr(), per_sm, ctypes.c_void_p(stream)) == 0
        go()
        times.append(statistics.median(triton_q4._flushed_graph_ms(go) for _ in range(3)) * 1e3)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qkv,o,gate_up,down,head")
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--kinds", default="fma,mma,rows,wg", help="the CUDA kernels timed (checks run them all)")
    ap.add_argument("--kernel-check", action="store_true", help="check the CUDA kernels only, not the engine's "
                    "matmul (no Triton autotuning)")
    a = ap.parse_args()
    if not a.no_check:
        check(engine=not a.kernel_check)
    dtype = getattr(torch, a.dtype)
    tab = triton_kernels._scale_table(torch.device("cuda"))
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        blocks = q4_0_blocks(n, k)
        codes, scales = triton_soa.soa(blocks, "q4_0", (n, k))
        gb = blocks.numel() / 1e6  # MB = bytes / 1e6, so MB / us = TB/s
        read_us = read_ceiling_us(blocks)
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k, device="cuda").to(dtype)
            y = torch.empty(m, n, device="cuda", dtype=dtype)
            ws, cnt = triton_soa._split_buffers(x.device)

            def tri():
                if m <= triton_soa.FMA_MAX_ROWS:
                    triton_q4.gemv4[lambda meta: (-(-n // meta["BLOCK_N"]), meta["SPLIT"])](
                        x, codes, scales, tab, y, y, ws, cnt, n, k, codes.shape[1], x.stride(0), y.stride(0),
                        HAS_BIAS=False, KIND=2, MP=m)
                else:
                    triton_q4_gemm.gemm4[lambda meta: (-(-n // meta["BLOCK_N"]), -(-m // meta["BLOCK_M"]))](
                        x, codes, scales, tab, y, y, m, n, k, codes.shape[1], x.stride(0), y.stride(0),
                        1 << (m - 1).bit_length(), HAS_BIAS=False, KIND=2, IEEE=x.dtype == torch.float32)
            tri()
            res = [("triton", statistics.median(triton_q4._flushed_graph_ms(tri) for _ in range(3)) * 1e3)]
            for cand in (c for c in candidates(x, "q4_0", k) if c[0] in a.kinds.split(",")):
                def cu(cand=cand):
                    cuda_q4.run(cand, x, blocks, codes, scales, tab, "q4_0", n, k, None, y)
                cu()
                res.append((label(cand), statistics.median(triton_q4._flushed_graph_ms(cu) for _ in range(3)) * 1e3))
            if x.dtype != torch.float32:  # the bf16 weight's cuBLAS matmul: what the q4 kernels replace
                def mm(dense=torch.randn(n, k, device="cuda", dtype=x.dtype)):
                    torch.mm(x, dense.t(), out=y)
                res.append(("cublas", statistics.median(triton_q4._flushed_graph_ms(mm) for _ in range(3)) * 1e3))
                del mm
            best = min((r for r in res[1:] if r[0] != "cublas"), key=lambda r: r[1])
            line = "  ".join(f"{lbl} {t:.1f}" for lbl, t in res)
            ceiling = f", read-only {gb / read_us:.2f} TB/s" if read_us else ""
            print(f"{name} {n}x{k} M={m}: {line}  | triton {gb / res[0][1]:.2f} TB/s, best {best[0]} "
                  f"{gb / best[1]:.2f} TB/s ({res[0][1] / best[1]:.2f}x){ceiling}", flush=True)


if __name__ == "__main__":
    main()
