"""Batch-1 greedy decode with and without speculative decoding, the draft being the model's own first N layers.

    python tools/bench_speculative.py [--model PATH] [--draft-layers 4,8,10] [--spec-tokens 4] [--new-tokens 128]
        [--device cuda --dtype bfloat16] [--graph-prefill-tokens 0,128]

Prints tok/s (median of ``--rounds`` after one untimed run) and the engine steps per generated token: 1.0 means the
target accepted no draft token, 1 / (k + 1) that it accepted all. ``--graph-prefill-tokens``: each setting is an
engine (on CUDA, 0 runs every speculative pass eagerly, N replays graphs for passes of up to N new tokens). The
model is loaded once. No timing is asserted anywhere.
"""
from __future__ import annotations

import statistics
import time

import inferflow
from inferflow.engine import Engine, EngineConfig, SamplingParams

import engine_bench_args

PROMPT = "The history of the Roman Empire spans many centuries. It began when"


def run(m, model_path: str, draft_layers: int, k: int, new: int, rounds: int, graph_tokens: int) -> tuple[float, float]:
    """tok/s and engine steps per token of one engine on ``m`` (the draft: ``model_path``'s first layers, loaded
    like ``m``)."""
    spec = {"speculative_model": model_path, "speculative_draft_layers": draft_layers,
            "num_speculative_tokens": k} if draft_layers else {}
    eng = Engine(m, EngineConfig(max_num_seqs=8, graph_prefill_tokens=graph_tokens, **spec))
    prompt = m.tokenizer.encode(PROMPT)
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    eng.generate([prompt], [sp])
    times, steps = [], 0
    for _ in range(rounds):
        t, handle = time.perf_counter(), eng.add_request(prompt, sp)
        n = sum(1 for _ in handle)
        times.append(time.perf_counter() - t)
        steps = n
    return new / statistics.median(times), steps / new


def main() -> None:
    ap = engine_bench_args.parser(__doc__, rounds=3)
    ap.add_argument("--draft-layers", default="4,8,10")
    ap.add_argument("--spec-tokens", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: the model file's")
    ap.add_argument("--graph-prefill-tokens", default="128", help="comma list: one engine per setting (CUDA)")
    args = ap.parse_args()
    path = engine_bench_args.setup(args)
    m = inferflow.load(path, device=args.device, dtype=args.dtype)
    for g in map(int, args.graph_prefill_tokens.split(",")):
        for n in [0, *map(int, args.draft_layers.split(","))]:
            tps, per = run(m, path, n, args.spec_tokens, args.new_tokens, args.rounds, g)
            what = f"draft = first {n} layers, k = {args.spec_tokens}" if n else "no speculation"
            print(f"graph_prefill_tokens {g}, {what}: {tps:.1f} tok/s, {per:.2f} steps per token", flush=True)


if __name__ == "__main__":
    main()
