"""What capturing the decode graphs costs, and where: at engine start (``capture_graphs_at_start``, the default) or
in the first serving step of each batch-size bucket (``False``).

    python tools/bench_graph_capture.py --model /tmp/qwen3-8b [--max-num-seqs 256] [--quant q4_0]

Starts an engine with every bucket captured at start and prints the engine's start time and each bucket's warm-up
+ capture time (``DecodeGraphs.capture_ms``): with capture on first use, that time is a stall of the serving step
that first meets the bucket (every request in flight waits on it). Then serves ``--requests`` short requests and
checks that their decode steps only replayed graphs captured at start (no capture in between). CUDA only.
"""
from __future__ import annotations

import argparse
import logging
import time

import torch

import inferflow
from inferflow.engine import Engine, EngineConfig, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--quant", help="quantize at load (q4_0, ...): its kernels' choices are timed at warm-up too")
    args = ap.parse_args()
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("inferflow.engine.cuda_graphs").setLevel(logging.DEBUG)  # each bucket as it is captured
    m = inferflow.load(args.model, device="cuda", dtype="bfloat16", quant=args.quant)
    t = time.perf_counter()
    eng = Engine(m, EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192, max_model_len=4096))
    start = time.perf_counter() - t
    g = eng.runner.graphs
    caps = dict(sorted(g.capture_ms.items()))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; engine start {start:.1f} s, of which "
          f"{sum(caps.values()) / 1000:.1f} s capturing {len(caps)} decode graphs")
    print("| bucket (rows) | " + " | ".join(map(str, caps)) + " |")
    print("|---|" + "---:|" * len(caps))
    print("| warm-up + capture ms | " + " | ".join(f"{v:.0f}" for v in caps.values()) + " |")
    captured = set(g._graphs)
    prompts = [[10 + (7 * i + j) % 1000 for j in range(32)] for i in range(args.requests)]
    t = time.perf_counter()
    outs = eng.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)] * len(prompts))
    took = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)
    print(f"{args.requests} requests x 16 tokens in {took:.2f} s: {g.replays} graph replays, graphs captured since "
          f"start: {sorted(set(g._graphs) - captured) or 'none'}")


if __name__ == "__main__":
    main()
