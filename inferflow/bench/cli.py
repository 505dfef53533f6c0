"""``inferflow bench``: offline throughput (optionally against HF transformers and llama.cpp, or over precision
classes for the docs) and serving latency against an inferflow-service. See docs/benchmarks.md."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from ..engine.kv_store import STORE_DTYPES
from ..errors import InferflowError

PEERS = ("hf", "llama.cpp")


def _ints(text: str) -> list[int]:
    vals = [int(x) for x in str(text).split(",") if x.strip()]
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return vals


def _rates(text: str) -> list[float]:
    try:
        vals = [float(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated request rates > 0 (inf: all at once), got {text!r}")
    return vals


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="inferflow bench", description="Offline throughput (optionally against HF transformers and llama.cpp, or over precision classes) and serving latency; see docs/benchmarks.md.")
    ap.add_argument("mode", nargs="?", choices=["offline", "serving"], default="offline")
    ap.add_argument("--model", help="model folder or file, GGUF as-is (default: the embedded default model)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 (CPU), bf16 (GPU)")
    ap.add_argument("--quant", help="quantize at load time: q8, q4, ... (inferflow/quant/plan.py)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, help="torch and llama.cpp threads (default: physical cores)")
    ap.add_argument("--batch", type=_ints, default=[1, 8], help="offline batch sizes, e.g. 1,8,64")
    ap.add_argument("--prompt-len", type=int, default=128, help="random prompt length in tokens")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--prompts-file", help="prompts, one per line (tokenized; else random token ids)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *STORE_DTYPES],
                    help="inferflow's K/V cache (EngineConfig.kv_cache_dtype; auto: the model's dtype). llama.cpp's "
                         "is f16 (its default), HF's the model's dtype")
    ap.add_argument("--vs", action="append", choices=PEERS, default=[], help="peer(s) to run interleaved with us")
    ap.add_argument("--hf-dir", help="where a GGUF's HF-layout copy is kept (reused if present)")
    ap.add_argument("--classes", help="precision classes f32,f16,q8_0,q4_0,file: GGUFs written from --model, each "
                                      "run by us and the peers (batch 1 vs llama.cpp, largest batch vs HF)")
    ap.add_argument("--work-dir", default=str(Path.home() / ".cache" / "inferflow" / "bench"),
                    help="where --classes keeps its GGUF files and HF copies")
    ap.add_argument("--doc", help="markdown file whose <!-- bench_cpu --> section gets the --classes table (serving: "
                                  "its <!-- bench_serving --> section gets the serving table)")
    ap.add_argument("--from-json", metavar="FILE", help="serving: write --doc from this earlier --json result "
                                                        "instead of running")
    ap.add_argument("--json", help="write all results as JSON here")
    ap.add_argument("--plot", metavar="DIR", help="write PNG charts here (needs matplotlib)")
    ap.add_argument("--profile", metavar="DIR", help="write a torch.profiler Chrome trace of a few engine steps")
    ap.add_argument("--profile-steps", type=int, default=8)
    s = ap.add_argument_group("serving")
    s.add_argument("--url", help="a running inferflow-service (default: start one in-process with --model)")
    s.add_argument("--served-model", help="model name on the service (default: its first)")
    s.add_argument("--api-key")
    s.add_argument("--num-prompts", type=int, default=32)
    s.add_argument("--request-rate", type=_rates, default=[float("inf")],
                   help="requests/s (inf: all at once); several (inf,8): one run each, fresh prompts per run")
    s.add_argument("--arrival", choices=["poisson", "fixed"], default="poisson")
    s.add_argument("--prefix-len", type=int, default=0, help="random prompts: the first N tokens shared between "
                   "prompts (--num-prefixes distinct prefixes, taken in turn): prefix-cache hits")
    s.add_argument("--num-prefixes", type=int, default=1)
    s.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    s.add_argument("--slo-ttft-ms", type=float)
    s.add_argument("--slo-tpot-ms", type=float)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--warmup-requests", type=int, default=1, help="untimed requests sent at once before each "
                   "timed run (their own random prompts): compiles kernels and captures graphs")
    s.add_argument("--warmup-tokens", type=int, default=16, help="new tokens per warm-up request")
    s.add_argument("--client", choices=["process", "thread"], default="process",
                   help="in-process service: the HTTP client runs in its own process (default; its threads "
                        "then do not compete with the engine for the GIL) or in threads of this one")
    e = ap.add_argument_group("serving: the in-process service's engine (EngineConfig)")
    e.add_argument("--max-num-seqs", type=int, help="running sequences (default: the largest --batch, >= 8)")
    e.add_argument("--max-num-batched-tokens", type=int, help="tokens per forward pass (prefill chunking)")
    e.add_argument("--max-model-len", type=int, help="prompt + output cap (smaller: less KV per sequence)")
    e.add_argument("--gpu-memory-utilization", type=float, help="CUDA: fraction of the GPU the model may use "
                   "(default 0.9; sizes the KV cache)")
    e.add_argument("--kv-cache-memory", type=float, help="GiB of KV cache (default: auto)")
    e.add_argument("--no-prefix-caching", action="store_true")
    return ap


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = parser()
    args = ap.parse_args(argv)
    if args.new_tokens < 2 or args.rounds < 1 or args.prompt_len < 1:
        ap.error("--new-tokens must be >= 2, --rounds and --prompt-len >= 1")
    if args.doc and not args.classes and args.mode != "serving":
        ap.error("--doc writes the --classes table (or the serving table): give --classes, or use serving mode")
    if args.from_json and not (args.mode == "serving" and args.doc):
        ap.error("--from-json writes the serving --doc section: give serving mode and --doc")
    if args.warmup_requests < 0 or args.warmup_tokens < 1:
        ap.error("--warmup-requests must be >= 0, --warmup-tokens >= 1")
    args.vs = list(dict.fromkeys(args.vs))
    return args


def setup_threads(args: argparse.Namespace) -> int:
    from .report import machine

    n = args.threads or machine().get("physical_cores") or torch.get_num_threads()
    torch.set_num_threads(n)
    return n


def source_of(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from ..default_model import default_model_path

    return default_model_path()


def bench_main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        if args.mode == "serving":
            from .run_serving import serving_bench

            serving_bench(args, argv)
        elif args.classes:
            from .run_classes import classes_bench

            classes_bench(args, argv)
        else:
            from .run_offline import offline_bench

            offline_bench(args, argv)
    except InferflowError as e:
        print(f"inferflow bench: {e}", file=sys.stderr)
        return 2
    return 0


def strip_outputs(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "outputs"} for r in results]
