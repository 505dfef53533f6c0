"""Time to first token of short prompts, eager prefill steps against graph replays (``graph_prefill_tokens``): two
engines on one model, interleaved, medians.

    python3 tools/random_hf_model.py qwen3-8b /tmp/qwen3-8b
    python3 tools/bench_short_prefill_gpu.py --model /tmp/qwen3-8b [--lens 16,32,64,128] [--tokens 128]
        [--rounds 5] [--quant q4_0] [--decoding 8]

Each round runs one fresh random prompt of each length per engine (no prefix-cache hits) and times it to its
first token. ``--decoding N``: N other sequences decode meanwhile, so the prompt's first step is a mixed one.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import inferflow  # noqa: E402
from inferflow.engine import Engine, EngineConfig, SamplingParams  # noqa: E402


def first_token_ms(eng: Engine, prompt: list[int], device: str) -> float:
    """Wall ms from adding ``prompt`` to its first token (other requests keep running)."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)).result()  # steps it
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def interleave(names: list[str], lens: list[int], rounds: int, run) -> dict[tuple[str, int], list[float]]:
    """``run(name, n)`` ms for every length and name, ``rounds`` times interleaved after one warm-up round."""
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds + 1):
        for n in lens:
            for name in names:
                ms = run(name, n)
                if r:
                    times.setdefault((name, n), []).append(ms)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quant", default="none")
    ap.add_argument("--lens", default="16,32,64,128")
    ap.add_argument("--tokens", type=int, default=128, help="graph_prefill_tokens of the graph engine")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--decoding", type=int, default=0, help="sequences decoding beside each prompt")
    a = ap.parse_args()
    model = inferflow.load(a.model, dtype="bfloat16" if a.device == "cuda" else "float32", device=a.device,
                           quant=None if a.quant == "none" else a.quant)
    base = dict(max_num_seqs=max(8, a.decoding + 1), max_model_len=1024, enable_prefix_caching=False,
                kv_cache_memory=4.0)
    engines = {"eager": Engine(model, EngineConfig(**base, graph_prefill_tokens=0)),
               "graphs": Engine(model, EngineConfig(**base, graph_prefill_tokens=a.tokens))}
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(10, 32000, (n,), generator=g).tolist()  # noqa: E731
    if a.decoding:  # long-running neighbours: each engine keeps N sequences decoding throughout
        for eng in engines.values():
            for _ in range(a.decoding):
                eng.add_request(rand(32), SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True))
    lens = [int(v) for v in a.lens.split(",")]
    times = interleave(list(engines), lens, a.rounds, lambda name, n: first_token_ms(engines[name], rand(n), a.device))
    for n in lens:
        e, gr = (statistics.median(times[(k, n)]) for k in engines)
        print(f"prompt {n} tokens{f' beside {a.decoding} decoding' if a.decoding else ''}: eager {e:.2f} ms, "
              f"graphs {gr:.2f} ms, {e / gr:.2f}x  (eager {[round(t, 2) for t in times[('eager', n)]]}, graphs "
              f"{[round(t, 2) for t in times[('graphs', n)]]})", flush=True)


if __name__ == "__main__":
    main()
