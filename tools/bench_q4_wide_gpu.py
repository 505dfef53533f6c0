"""4-bit steps of 65-256 rows inside CUDA graphs: quant/q4_wide.py's timed choice (the fused GEMM, decode + cuBLAS,
64-row chunks or, on Hopper, the warpgroup-MMA GEMM), against the fused GEMM throughout (``INFERFLOW_Q4_WIDE=0``
while that engine captures its graphs), with bf16 beside them. Three engines on one model, interleaved, medians.

    python3 tools/random_hf_model.py qwen3-8b /tmp/qwen3-8b
    python3 tools/bench_q4_wide_gpu.py --model /tmp/qwen3-8b [--batches 128,256] [--lens 96,128] [--rounds 3]
    python3 tools/bench_q4_wide_gpu.py --kernels 80,96,128,160   # each candidate per layer shape, µs per call

Per round and engine: batched decode tok/s at each batch (``--new-tokens`` after the prompts' first tokens, as
tools/bench_gpu.py counts them), and the time to first token of one lone prompt of each length (a graph replay
where ``graph_prefill_tokens`` covers it). Graphs are captured on first use, inside each engine's warm-up.
"""
import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import inferflow  # noqa: E402
from inferflow.engine import Engine, EngineConfig  # noqa: E402

from bench_gpu_ours import leading_same, ours_decode  # noqa: E402
from bench_short_prefill_gpu import first_token_ms  # noqa: E402


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def kernels(rows: list[int]) -> None:
    """µs per call of each candidate (quant/q4_wide.py) per Qwen3-8B layer shape, as the warm-up times them."""
    from inferflow.quant import formats, triton_kernels, triton_soa
    from inferflow.quant.triton_q4 import _flushed_graph_ms

    tab = triton_kernels._scale_table(torch.device("cuda"))
    for name, (n, k) in SHAPES.items():
        p = formats.quantize(torch.randn(n, k, device="cuda"), "q4_0")
        blocks = p.data.reshape(n, -1)
        codes, scales = triton_soa.soa(blocks, "q4_0", (n, k))
        for m in rows:
            x = torch.randn(m, k, device="cuda").bfloat16()
            calls = triton_soa.wide_calls(x, blocks, codes, scales, tab, "q4_0", (n, k), None)
            ref = calls["fused"]().float()
            us = {}
            for cand, call in calls.items():
                err = ((call().float() - ref).abs().max() / ref.abs().max()).item()
                us[cand] = f"{_flushed_graph_ms(call) * 1e3:.1f} (diff {err:.1e})"
            print(f"{name} {n}x{k}, {m} rows: " + ", ".join(f"{c} {v}" for c, v in us.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", help="only time each candidate per layer shape at these rows (comma list)")
    ap.add_argument("--model")
    ap.add_argument("--batches", default="128,256")
    ap.add_argument("--lens", default="96,128")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.kernels:
        return kernels([int(v) for v in a.kernels.split(",")])
    if not a.model:
        ap.error("--model is required (or --kernels)")
    batches, lens = [int(v) for v in a.batches.split(",")], [int(v) for v in a.lens.split(",")]
    cfg = EngineConfig(max_num_seqs=max(batches), max_model_len=a.prompt_len + a.new_tokens + 16,
                       max_num_batched_tokens=16384, enable_prefix_caching=False, kv_cache_memory=8.0,
                       capture_graphs_at_start=False)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(10, 32000, (n,), generator=g).tolist()  # noqa: E731
    prompts = {b: [rand(a.prompt_len) for _ in range(b)] for b in batches}
    bf16 = inferflow.load(a.model, dtype="bfloat16", device="cuda")
    q4 = inferflow.load(a.model, dtype="bfloat16", device="cuda", quant="q4_0")
    engines = {"q4, timed": Engine(q4, cfg), "q4, fused only": Engine(q4, cfg), "bf16": Engine(bf16, cfg)}
    for name, eng in engines.items():  # warm-up: each bucket's graph captured here, under the engine's setting
        os.environ["INFERFLOW_Q4_WIDE"] = "0" if name == "q4, fused only" else "1"
        for b in batches:
            ours_decode(eng, prompts[b], 4, "cuda")
        for n in lens:
            first_token_ms(eng, rand(n), "cuda")
        print(f"{name}: warm", flush=True)
    os.environ["INFERFLOW_Q4_WIDE"] = "1"
    tps: dict[tuple[str, int], list[float]] = {}
    ttft: dict[tuple[str, int], list[float]] = {}
    toks: dict[tuple[str, int], list[list[int]]] = {}
    for _ in range(a.rounds):
        for name, eng in engines.items():
            for b in batches:
                t, toks[(name, b)] = ours_decode(eng, prompts[b], a.new_tokens, "cuda")
                tps.setdefault((name, b), []).append(t)
            for n in lens:
                ttft.setdefault((name, n), []).append(first_token_ms(eng, rand(n), "cuda"))
    for b in batches:
        med = {name: statistics.median(tps[(name, b)]) for name in engines}
        print(f"decode, batch {b}: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in med.items())
              + f"; timed / fused {med['q4, timed'] / med['q4, fused only']:.2f}x, timed / bf16 "
              f"{med['q4, timed'] / med['bf16']:.2f}x  (samples {[[round(x) for x in tps[(k, b)]] for k in engines]})",
              flush=True)
        same = [leading_same(x, y) for x, y in zip(toks[("q4, timed", b)], toks[("q4, fused only", b)])]
        print(f"  greedy tokens, q4 timed against fused only: {sum(v == a.new_tokens for v in same)}/{b} sequences "
              f"equal throughout, median leading run {statistics.median(same)} of {a.new_tokens}", flush=True)
    for n in lens:
        med = {name: statistics.median(ttft[(name, n)]) for name in engines}
        print(f"first token, {n}-token prompt: " + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items())
              + f"  (samples {[[round(x, 1) for x in ttft[(k, n)]] for k in engines]})", flush=True)
    from inferflow.quant import q4_wide

    picks: dict[str, list[str]] = {}
    for key, choice in q4_wide._choice.items():
        picks.setdefault(choice, []).append(f"{key[0]}x{key[1]}x{key[2]}")
    print(f"choices: {picks}", flush=True)


if __name__ == "__main__":
    main()
