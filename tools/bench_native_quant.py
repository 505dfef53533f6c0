"""Native ggml block kernels (inferflow/native/gemv_ggml.c, kind "native") against today's torch fast path.

    PYTHONPATH=. python tools/bench_native_quant.py [--threads 1] [--rounds 7] [--types Q8_0,Q4_0,Q4_1] [--m 1,8]

Per block type, default-model shape (N x K: 576x576, fused q/k/v 960x576, fused gate/up 3072x576, down 576x1536,
the Q8_0 vocab head 49152x576) and batch rows M, both linears are built from the same random blocks: "native"
(inferflow.quant.cpu_kernels with the native kernels on) and "torch" (the same with $INFERFLOW_NATIVE=0: the int4
kernel, or for the Q8_0 head its float32 copy, "dense"). They are timed interleaved round by round (A, B, A, B:
the shared VM drifts) and the medians printed: us/call, GB/s of block bytes read by native, torch/native ratio
(> 1: native faster), and the max relative error of each against the exact float64 product.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import gguf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # random GGUF blocks

from inferflow.quant import PackedTensor, cpu_kernels, ggml  # noqa: E402
from inferflow.registry import create  # noqa: E402
import components  # noqa: E402,F401 - registers "linear"
from gguf_files import random_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
SHAPES = [(576, 576), (960, 576), (3072, 576), (576, 1536), (49152, 576)]


def held(blocks: torch.Tensor, qtype: int, shape: tuple[int, int], native_on: bool) -> torch.nn.Module:
    old = os.environ.get("INFERFLOW_NATIVE")
    os.environ["INFERFLOW_NATIVE"] = "1" if native_on else "0"
    try:
        lin = create("linear", {"in_features": shape[1], "out_features": shape[0], "bias": False})
        with cpu_kernels.using("fast"):
            lin.load_packed("weight", PackedTensor(blocks, qtype, shape), torch.float32)
    finally:
        if old is None:
            os.environ.pop("INFERFLOW_NATIVE")
        else:
            os.environ["INFERFLOW_NATIVE"] = old
    return lin


def per_call(lin: torch.nn.Module, x: torch.Tensor, seconds: float) -> float:
    lin(x)
    n, t0 = 0, time.perf_counter()
    while True:
        lin(x)
        n += 1
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return dt / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seconds", type=float, default=0.05, help="per timing of one system in one round")
    ap.add_argument("--types", default="Q8_0,Q4_0,Q4_1", help="also Q5_0, Q5_1, Q4_K, Q6_K")
    ap.add_argument("--m", default="1,8")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ms = [int(m) for m in a.m.split(",")]
    print(f"threads={a.threads} rounds={a.rounds}  (ratio = torch/native median us/call: > 1 means native is faster)")
    print(f"{'type':5} {'N x K':>11} {'M':>3} {'kind B':>7} {'native us':>10} {'GB/s':>6} {'torch us':>9} "
          f"{'ratio':>6} {'err nat':>8} {'err torch':>9}")
    for name in a.types.split(","):
        qtype = int(Q[name])
        for n, k in SHAPES:
            if (n == 49152 and qtype != ggml.Q8_0) or k % ggml.block_size(qtype)[0]:
                continue  # the vocab head is Q8_0 in every class file; k-quants need K % 256 == 0
            blocks = random_blocks(Q[name], n, k, 0)
            nat, ref = held(blocks, qtype, (n, k), True), held(blocks, qtype, (n, k), False)
            assert nat.kernels["weight"] == "native", nat.kernels
            w = ggml.dequantize(blocks, qtype, (n, k)).double()
            for m in ms:
                x = torch.randn(m, k)
                exact = x.double() @ w.T
                err = [((lin(x).double() - exact).abs().max() / exact.abs().max()).item() for lin in (nat, ref)]
                ta, tb = [], []
                for _ in range(a.rounds):
                    ta.append(per_call(nat, x, a.seconds))
                    tb.append(per_call(ref, x, a.seconds))
                ma, mb = statistics.median(ta), statistics.median(tb)
                print(f"{name:5} {n:>5}x{k:<5} {m:>3} {ref.kernels['weight']:>7} {ma * 1e6:>10.1f} "
                      f"{blocks.numel() / ma / 1e9:>6.1f} {mb * 1e6:>9.1f} {mb / ma:>6.2f} {err[0]:>8.1e} "
                      f"{err[1]:>9.1e}", flush=True)


if __name__ == "__main__":
    main()
