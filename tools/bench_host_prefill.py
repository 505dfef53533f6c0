"""The engine's host work per prefill step, apart from the model's forward: admission, prefix hashing, staging.

    PYTHONPATH=. python tools/bench_host_prefill.py [--prompts 4] [--len 2048] [--rounds 5] [--prefix-caching]

A one-layer toy Qwen3 on the CPU (its forward is timed separately and subtracted), the bench's prefill workload
(``--prompts`` random prompts of ``--len`` tokens, ``max_tokens=1``, one step). Prints, per round, the wall time of
the run, the forward's time and the difference: the host work a GPU run would also pay, whatever its forward
costs. No timing is asserted anywhere.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_gpu import TINY  # noqa: E402
from bench_gpu_ours import load_shared, ours_prefill  # noqa: E402

from inferflow.engine import Engine, EngineConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prefix-caching", action="store_true")
    args = ap.parse_args()
    import transformers

    torch.manual_seed(0)
    vocab = 1000
    cfg = transformers.Qwen3Config(**{**TINY, "num_hidden_layers": 1, "vocab_size": vocab})
    hf = transformers.Qwen3ForCausalLM(cfg).eval().to(torch.bfloat16)
    model = load_shared(hf, tempfile.mkdtemp(prefix="host-prefill-"), "cpu")
    tokens = args.prompts * args.len
    eng = Engine(model, EngineConfig(max_num_seqs=max(8, args.prompts), max_model_len=args.len + 16,
                                     max_num_batched_tokens=tokens, enable_prefix_caching=args.prefix_caching,
                                     kv_cache_memory=0.5))
    forward = model.forward_packed
    spent = [0.0]

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return forward(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t

    model.forward_packed = timed
    g = torch.Generator().manual_seed(1)
    host = []
    for r in range(args.rounds + 1):  # round 0 warms up
        prompts = torch.randint(10, vocab, (args.prompts, args.len), generator=g).tolist()
        spent[0] = 0.0
        t0 = time.perf_counter()
        ours_prefill(eng, prompts, "cpu")
        wall = (time.perf_counter() - t0) * 1e3
        if r:
            host.append(wall - spent[0] * 1e3)
            print(f"round {r}: wall {wall:.1f} ms, forward {spent[0] * 1e3:.1f} ms, host {host[-1]:.2f} ms")
    print(f"host work per {tokens}-token prefill step: median {statistics.median(host):.2f} ms "
          f"(prefix caching {'on' if args.prefix_caching else 'off'})")


if __name__ == "__main__":
    main()
