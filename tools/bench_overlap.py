"""Overlapped decode (EngineConfig.async_scheduling, engine/overlap.py) on vs off, interleaved per round.

    python tools/bench_overlap.py [--out DIR] [--rounds 3] [--batches 1,64] [--tiny]

The Qwen3-8B-shaped bf16 model of tools/bench_gpu.py (random weights built on the GPU), two engines over the same
weights (one per setting), greedy decode of 128-token prompts for 128 new tokens, EOS ignored; tok/s after each
request's first token (bench_gpu's measure), medians and on/off ratios, the GPU time of one graph replay of each
bucket, and whether both settings give the same greedy tokens. Writes ``bench_overlap.json`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_gpu as bg  # noqa: E402
from inferflow.engine import Engine, EngineConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = [int(b) for b in args.batches.split(",")]
    shape = bg.TINY if args.tiny else bg.QWEN3_8B
    torch.manual_seed(0)
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape)).eval()
        torch.set_default_dtype(torch.float32)
    model = bg.load_shared(hf, tempfile.mkdtemp(prefix="bench-overlap-"), device)
    del hf
    bg.log("model loaded")
    ecfg = dict(max_num_seqs=max(batches), max_model_len=args.prompt_len + args.new_tokens + 16,
                max_num_batched_tokens=16384, enable_prefix_caching=False, kv_cache_memory=2.0 if args.tiny else 8.0)
    engines = {name: Engine(model, EngineConfig(**ecfg, async_scheduling=on))
               for name, on in (("overlap", True), ("sync", False))}
    g = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(10, shape["vocab_size"], (b, args.prompt_len), generator=g).tolist() for b in batches}
    for b in batches:
        for e in engines.values():
            bg.ours_decode(e, prompts[b], 4, device)  # graphs captured, kernels compiled
    bg.log("warm-up done")
    res: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                 "batches": batches, "new_tokens": args.new_tokens}
    samples: dict[str, list[float]] = {}
    tokens: dict[str, dict[int, list]] = {}
    for r in range(args.rounds):
        for b in batches:
            for name, e in engines.items():
                t0 = time.perf_counter()
                tps, toks = bg.ours_decode(e, prompts[b], args.new_tokens, device)
                samples.setdefault(f"{name} b{b}", []).append(tps)
                tokens.setdefault(name, {})[b] = toks
                bg.log(f"round {r + 1} {name} b{b}: {tps:.1f} tok/s ({time.perf_counter() - t0:.2f} s)")
    med = {k: statistics.median(v) for k, v in samples.items()}
    res["tps"] = med
    res["samples"] = samples
    res["ratio_overlap_over_sync"] = {b: med[f"overlap b{b}"] / med[f"sync b{b}"] for b in batches}
    res["same_greedy_tokens"] = {b: tokens["overlap"][b] == tokens["sync"][b] for b in batches}
    ov = engines["overlap"].overlap
    res["overlap_counters"] = None if ov is None else {"launches": ov.launches, "continuations": ov.continuations,
                                                        "discarded": ov.discarded}
    if device == "cuda":
        res["graph_gpu_ms"] = bg.graph_gpu_ms(engines["sync"], batches)
    print(json.dumps(res, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "bench_overlap.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
