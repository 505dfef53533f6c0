"""Decode at batch sizes between powers of two: graph buckets at powers of two only, against the default buckets
(``EngineConfig.cuda_graph_sizes``: steps of a quarter of the power of two from 32 on). Two engines on one model,
interleaved, medians; and each engine's start (every graph captured).

    python3 tools/random_hf_model.py qwen3-8b /tmp/qwen3-8b
    python3 tools/bench_graph_sizes_gpu.py --model /tmp/qwen3-8b [--quant q4_0] [--batches 40,72,100,136,200]

Decode tok/s counts the tokens after each prompt's first, as tools/bench_gpu.py does.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import inferflow  # noqa: E402
from inferflow.engine import Engine, EngineConfig  # noqa: E402

from bench_gpu_ours import ours_decode  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--quant", default="none")
    ap.add_argument("--batches", default="40,72,100,136,200")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    batches = [int(v) for v in a.batches.split(",")]
    pow2 = [1 << i for i in range(a.max_num_seqs.bit_length()) if 1 << i < a.max_num_seqs]
    base = dict(max_num_seqs=a.max_num_seqs, max_model_len=a.prompt_len + a.new_tokens + 16,
                max_num_batched_tokens=16384, enable_prefix_caching=False, kv_cache_memory=8.0)
    model = inferflow.load(a.model, dtype="bfloat16", device="cuda", quant=None if a.quant == "none" else a.quant)
    engines: dict[str, Engine] = {}
    for name, sizes in (("powers of two", pow2), ("default", None)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engines[name] = Engine(model, EngineConfig(**base, cuda_graph_sizes=sizes))
        torch.cuda.synchronize()
        g = engines[name].runner.graphs
        print(f"{name}: {len(g.decode_buckets)} decode buckets {g.decode_buckets}, chained "
              f"{sorted(g._chained)}; engine start {time.perf_counter() - t0:.1f} s", flush=True)
    gen = torch.Generator().manual_seed(0)
    prompts = {b: [torch.randint(10, 32000, (a.prompt_len,), generator=gen).tolist() for _ in range(b)]
               for b in batches}
    for eng in engines.values():
        for b in batches:
            ours_decode(eng, prompts[b], 4, "cuda")
    tps: dict[tuple[str, int], list[float]] = {}
    for _ in range(a.rounds):
        for b in batches:
            for name, eng in engines.items():
                tps.setdefault((name, b), []).append(ours_decode(eng, prompts[b], a.new_tokens, "cuda")[0])
    for b in batches:
        p, d = (statistics.median(tps[(name, b)]) for name in engines)
        rows = {name: eng.runner.graphs.bucket(b) for name, eng in engines.items()}
        print(f"batch {b}: powers of two ({rows['powers of two']} rows) {p:.1f} tok/s, default ({rows['default']} "
              f"rows) {d:.1f} tok/s, {d / p:.2f}x  (samples {[[round(x) for x in tps[(n, b)]] for n in engines]})",
              flush=True)


if __name__ == "__main__":
    main()
