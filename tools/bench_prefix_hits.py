"""Time to first token of a batch of prefix-cache hits: ``--hits`` prompts that share ``--prefix`` cached tokens and
add ``--new`` tokens each, through the engine (one token generated), median of ``--rounds`` after one untimed.

    python tools/bench_prefix_hits.py [--model PATH] [--device cpu] [--hits 16 --prefix 496 --new 16]

The prefix is computed once first, so each timed batch is a step of chunks on cached keys: what the paged backend's
chunk paths (one native call on the CPU, one varlen call on CUDA) serve. To compare code versions, run this file
under each tree's PYTHONPATH in turns. No timing is asserted anywhere.
"""
from __future__ import annotations

import random
import statistics
import time

import inferflow
from inferflow.engine import Engine, EngineConfig, SamplingParams

import engine_bench_args


def main() -> None:
    ap = engine_bench_args.parser(__doc__, rounds=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype")
    ap.add_argument("--hits", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=496)
    ap.add_argument("--new", type=int, default=16)
    args = ap.parse_args()
    m = inferflow.load(engine_bench_args.setup(args), device=args.device, dtype=args.dtype)
    eng = Engine(m, EngineConfig(max_num_seqs=max(16, args.hits), max_num_batched_tokens=max(2048, args.hits * args.new)))
    rng = random.Random(0)
    vocab = int(m.params["vocab_size"])
    prefix = [rng.randrange(10, vocab) for _ in range(args.prefix)]
    sp = SamplingParams(temperature=0.0, max_tokens=1)
    eng.generate([prefix + [11] * args.new], [sp])  # the prefix, cached
    times = []
    for _ in range(args.rounds + 1):
        prompts = [prefix + [rng.randrange(10, vocab) for _ in range(args.new)] for _ in range(args.hits)]
        t = time.perf_counter()
        eng.generate(prompts, [sp] * args.hits)
        times.append(time.perf_counter() - t)
    print(f"{args.hits} prefix hits ({args.prefix} cached + {args.new} new tokens each) -> first token: median "
          f"{statistics.median(times[1:]) * 1000:.0f} ms over {args.rounds} rounds "
          f"({', '.join(f'{x * 1000:.0f}' for x in times)} ms)")


if __name__ == "__main__":
    main()
