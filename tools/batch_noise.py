"""How much a request's greedy logprobs move with the batch it lands in, exact block decode vs int8 activations.

    PYTHONPATH=. python tools/batch_noise.py [MODEL] [--trials 3] [--requests 24] [--threads 2]

A reference engine runs 8 prompts together; a second engine with a small KV pool (preemptions) takes the same
prompts again in a random order, a few arriving per step (prefix-cache hits, mixed prefill/decode steps,
recomputed preemptions), as a loaded service does. For each mode (``$INFERFLOW_NATIVE_Q8X`` 0 and 1; default
model when MODEL is omitted) it prints how many requests' logprobs differ from the reference at all, the largest
change of the reference token's logprob at the first and the last generated token, and how many texts differ.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import inferflow  # noqa: E402
from inferflow.engine.config import EngineConfig  # noqa: E402
from inferflow.engine.engine import Engine  # noqa: E402
from inferflow.engine.sampling_params import SamplingParams  # noqa: E402
from tools import model_args  # noqa: E402

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,", "Once upon a time",
           "The best way to learn", "Water boils at", "My favourite colour is", "import numpy as"]


def _staggered(model, ids: list[list[int]], sp: SamplingParams, n: int, seed: int) -> dict[str, tuple[int, object]]:
    eng = Engine(model, EngineConfig(max_num_seqs=8, max_waiting=8, block_size=4, num_blocks=16, max_model_len=256))
    rng = random.Random(seed)
    pending = [rng.randrange(len(ids)) for _ in range(n)]
    which, outs = {}, {}
    while pending or eng.has_unfinished():
        for _ in range(rng.randrange(0, 4)):
            if pending:
                rid = f"r{len(which)}"
                which[rid] = pending.pop()
                eng.add_request(ids[which[rid]], sp, request_id=rid)
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = (which[out.request_id], out.outputs[0])
    return outs


def _top(lp: dict) -> tuple[int, float]:
    return max(lp.items(), key=lambda kv: kv[1])


def main() -> None:
    def options(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--trials", type=int, default=3)
        ap.add_argument("--requests", type=int, default=24)

    a = model_args.parse(__doc__, options)
    model = inferflow.load(a.model)
    ids = [model.tokenizer.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1)
    for mode in ("0", "1"):
        os.environ["INFERFLOW_NATIVE_Q8X"] = mode
        ref = [r.outputs[0] for r in Engine(model, EngineConfig(max_num_seqs=8)).generate(ids, sp)]
        for trial in range(a.trials):
            outs = _staggered(model, ids, sp, a.requests, trial).values()
            moved = sum(o.logprobs != ref[p].logprobs for p, o in outs)
            texts = sum(o.text != ref[p].text for p, o in outs)
            drift = []
            for at in (0, -1):
                same = [(_top(o.logprobs[at]), _top(ref[p].logprobs[at])) for p, o in outs]
                drift.append(max((abs(x[1] - y[1]) for x, y in same if x[0] == y[0]), default=0.0))
            print(f"INFERFLOW_NATIVE_Q8X={mode} trial {trial}: {moved}/{len(outs)} requests' logprobs differ, "
                  f"max |d logprob| first token {drift[0]:.4f}, last {drift[1]:.4f}; {texts} texts differ",
                  flush=True)


if __name__ == "__main__":
    main()
