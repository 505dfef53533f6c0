"""Batch-1 greedy decode with and without speculative decoding, the draft being the model's own first N layers.

    python tools/bench_speculative.py [--model PATH] [--draft-layers 4,8,10] [--spec-tokens 4] [--new-tokens 128]

Prints tok/s (median of ``--rounds`` after one untimed run) and the engine steps per generated token: 1.0 means the
target accepted no draft token, 1 / (k + 1) that it accepted all. No timing is asserted anywhere.
"""
from __future__ import annotations

import statistics
import time

import inferflow
from inferflow.engine import Engine, EngineConfig, SamplingParams

import engine_bench_args

PROMPT = "The history of the Roman Empire spans many centuries. It began when"


def run(model_path: str, draft_layers: int, k: int, new: int, rounds: int) -> tuple[float, float]:
    m = inferflow.load(model_path)
    spec = {"speculative_model": model_path, "speculative_draft_layers": draft_layers,
            "num_speculative_tokens": k} if draft_layers else {}
    eng = Engine(m, EngineConfig(max_num_seqs=8, **spec))
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
    args = ap.parse_args()
    path = engine_bench_args.setup(args)
    for n in [0, *map(int, args.draft_layers.split(","))]:
        tps, per = run(path, n, args.spec_tokens, args.new_tokens, args.rounds)
        what = f"draft = first {n} layers, k = {args.spec_tokens}" if n else "no speculation"
        print(f"{what}: {tps:.1f} tok/s, {per:.2f} steps per token", flush=True)


if __name__ == "__main__":
    main()
