"""The GPU 4-bit GEMV on int8 activations (inferflow/quant/triton_q4x.py) vs the float32 one (triton_q4.gemv4).

    python tools/bench_q4x_gpu.py [--rows 1,2] [--e2e] [--rounds 3] [--new-tokens 128]

Kernels: random Q4_0 blocks of a Qwen3-8B decoder's projections (q/k/v, o, gate/up, down, the vocabulary head),
bf16 activations. For each shape and row count it checks both kernels against float64 references (the int8 one
against llama.cpp's arithmetic, both against the dequantized weight), then times each call in CUDA graphs with
L2 flushed between calls (as a decode step runs them). It prints microseconds and TB/s of blocks read.

``--e2e``: the same Qwen3-8B-shaped model as tools/bench_gpu.py (random bf16 weights, made into q4_0 at load). It
runs three engines: q4 captured with the int8 GEMV, q4 captured with the float32 one, and bf16. It reports batch-1
decode tok/s as medians of ``--rounds`` interleaved rounds, and the greedy tokens each q4 run shares with bf16's.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton  # noqa: E402

from inferflow.quant import triton_kernels, triton_q4, triton_q4x, triton_soa  # noqa: E402
from inferflow.quant.ggml import Q4_0  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "head": (151936, 4096)}


def random_q4_0(n: int, k: int, device: str) -> torch.Tensor:
    """uint8 [n, k / 32 * 18]: random codes, fp16 scales of a ~0.02-std weight."""
    nb = k // 32
    b = torch.randint(0, 256, (n, nb, 18), dtype=torch.uint8, device=device)
    d = (torch.rand(n, nb, device=device) * 0.004 + 0.001).half()
    b[:, :, :2] = d.view(torch.uint8).reshape(n, nb, 2)
    return b.reshape(n, nb * 18)


def references(x: torch.Tensor, blocks: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(llama.cpp's q4_0 x q8 arithmetic, the float matmul) in float64 on the device."""
    n, k = shape
    nb, m = k // 32, x.shape[0]
    b = blocks.reshape(n, nb, 18)
    q = torch.cat([b[:, :, 2:] & 15, b[:, :, 2:] >> 4], dim=-1).double()
    d = b[:, :, :2].contiguous().view(torch.float16).reshape(n, nb).double()
    xb = x.float().reshape(m, nb, 32)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    qx = torch.floor(xb * inv[..., None] + 0.5).double()
    dx = (amax / 127.0).double()
    si = torch.einsum("nbj,mbj->mnb", q, qx)
    int8 = (d[None] * (dx[:, None, :] * si - 8.0 * (qx.sum(-1) * dx)[:, None, :])).sum(-1)
    w = (d[:, :, None] * (q - 8.0)).reshape(n, k)
    return int8, x.double() @ w.t()


def kernels(rows: list[int]) -> None:
    dev = "cuda"
    print(f"{'shape':8} {'N x K':>13} {'M':>2} {'float32 us':>10} {'TB/s':>5} {'int8 us':>8} {'TB/s':>5}  "
          f"err int8 vs llama.cpp / vs float")
    for name, (n, k) in SHAPES.items():
        blocks = random_q4_0(n, k, dev)
        copies = [blocks] + [blocks.clone() for _ in range(max(1, (256 << 20) // blocks.numel()))]
        for m in rows:
            x = torch.randn(m, k, device=dev).bfloat16()
            times = {}
            for mode in ("0", "1"):
                os.environ["INFERFLOW_TRITON_Q8X"] = mode
                y = triton_kernels.matmul(x, blocks, Q4_0, (n, k))  # autotunes here
                for c in copies:  # the float32 kernel's repacked copies, made before any graph capture
                    triton_kernels.matmul(x, c, Q4_0, (n, k))
                if mode == "1":
                    ref8, ref = references(x, blocks, (n, k))
                    e8 = ((y.double() - ref8).abs().max() / ref8.abs().max()).item()
                    ef = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                i = [0]

                def call():
                    i[0] = (i[0] + 1) % len(copies)
                    triton_kernels.matmul(x, copies[i[0]], Q4_0, (n, k))
                times[mode] = statistics.median(triton_q4._flushed_graph_ms(call) for _ in range(3)) * 1e3
            # the same kernel on a structure-of-arrays copy (int32 code words, 16-bit headers): aligned 16-byte loads
            nb = k // 32
            b3 = blocks.reshape(n, nb, 18)
            soa = [(c.reshape(n, nb, 18)[:, :, 2:].contiguous().view(torch.int32).reshape(n, nb * 4),
                    c.reshape(n, nb, 18)[:, :, :2].contiguous().view(torch.int16).reshape(n, nb)) for c in copies]
            xq = torch.empty(m, k // 4, dtype=torch.int32, device=dev)
            xs = torch.empty(m, 2, nb, dtype=torch.float32, device=dev)
            ys = torch.empty(m, n, dtype=x.dtype, device=dev)
            ws, cnt = triton_soa._split_buffers(x.device)
            tab = triton_kernels._scale_table(x.device)

            def call_soa(c):
                triton_q4x.quant_x8[(triton.cdiv(nb, 32), m)](x, xq, xs, k, x.stride(0), BB=32)
                triton_q4x.gemv4x[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT"])](
                    xq, xs, c[0], c[1], tab, ys, ys, ws, cnt, n, k, c[0].stride(0), ys.stride(0), HAS_BIAS=False,
                    KIND=2, MP=m, INTERP=False, SOA=True)
            call_soa(soa[0])
            es = ((ys.double() - ref8).abs().max() / ref8.abs().max()).item()
            del b3
            i = [0]

            def call2():
                i[0] = (i[0] + 1) % len(soa)
                call_soa(soa[i[0]])
            times["soa"] = statistics.median(triton_q4._flushed_graph_ms(call2) for _ in range(3)) * 1e3
            gb = blocks.numel() / 1e6
            print(f"{name:8} {n:6}x{k:<6} {m:2} {times['0']:10.1f} {gb / times['0']:5.2f} {times['1']:8.1f} "
                  f"{gb / times['1']:5.2f}  {e8:.1e} / {ef:.1e}  soa {times['soa']:.1f} us {gb / times['soa']:.2f} TB/s "
                  f"err {es:.1e}", flush=True)


def e2e(rounds: int, new_tokens: int) -> None:
    import transformers

    from inferflow.engine import Engine, EngineConfig
    from bench_gpu import QWEN3_8B
    from bench_gpu_ours import leading_same, load_shared, ours_decode

    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3_8B)).eval()
        torch.set_default_dtype(torch.float32)
    tmp = tempfile.mkdtemp(prefix="bench-q4x-")
    cfg = dict(max_num_seqs=4, max_model_len=512, enable_prefix_caching=False, kv_cache_memory=4.0)
    bf16 = Engine(load_shared(hf, tmp, "cuda"), EngineConfig(**cfg))
    qm = load_shared(hf, tmp, "cuda", quant="q4_0")
    prompt = [torch.randint(10, 150000, (128,), generator=torch.Generator().manual_seed(1)).tolist()]
    engines = {}
    for name, mode in (("q4 int8 x", "1"), ("q4 float x", "0")):
        os.environ["INFERFLOW_TRITON_Q8X"] = mode
        engines[name] = (Engine(qm, EngineConfig(**cfg)), mode)
        ours_decode(engines[name][0], prompt, 4, "cuda")  # decode graphs captured with this kernel
    engines["bf16"] = (bf16, "1")
    ours_decode(bf16, prompt, 4, "cuda")
    tps: dict[str, list[float]] = {}
    toks: dict[str, list[int]] = {}
    for r in range(rounds):
        for name, (eng, mode) in engines.items():
            os.environ["INFERFLOW_TRITON_Q8X"] = mode  # the prefill's eager calls follow the switch too
            t, out = ours_decode(eng, prompt, new_tokens, "cuda")
            tps.setdefault(name, []).append(t)
            toks[name] = out[0]
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in tps.items()), flush=True)
    base = statistics.median(tps["bf16"])
    for name, v in tps.items():
        print(f"{name:11} {statistics.median(v):7.1f} tok/s  {statistics.median(v) / base:.2f}x bf16  "
              f"leading tokens equal to bf16's: {leading_same(toks[name], toks['bf16'])}/{len(toks['bf16'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    a = ap.parse_args()
    kernels([int(r) for r in a.rows.split(",")])
    if a.e2e:
        e2e(a.rounds, a.new_tokens)


if __name__ == "__main__":
    main()
