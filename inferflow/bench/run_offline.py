"""``inferflow bench [offline]``: one model at several batch sizes, optionally interleaved with peers."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any, Callable

from .cli import setup_threads, source_of, strip_outputs
from .offline import InferflowSystem, file_prompts, measure, random_prompts, ratios, rss_mb
from .report import header, machine_line, md_table, write_json


def workload(args: argparse.Namespace, model: Any, n: int) -> list[list[int]]:
    if args.prompts_file:
        if model.tokenizer is None:
            raise ValueError("--prompts-file needs a model with a tokenizer")
        return file_prompts(args.prompts_file, n, model.tokenizer, args.prompt_len)
    return random_prompts(n, args.prompt_len, int(model.params["vocab_size"]), seed=args.seed)


def load_ours(path: Path | str, args: argparse.Namespace, dtype: str | None = None) -> tuple[Any, float]:
    """The model and the resident memory its loading added (MiB)."""
    import inferflow

    before = rss_mb()
    model = inferflow.load(path, dtype=dtype or args.dtype, device=args.device, quant=args.quant)
    return model, rss_mb() - before


def profile_engine(system: InferflowSystem, prompts: list[list[int]], folder: str, steps: int) -> str:
    """A trace of ``steps`` engine steps of a fresh run of ``prompts`` (prefill first, then decodes)."""
    from ..engine.profiling import StepProfiler

    prof = system.engine.profiler = StepProfiler(folder, steps, name="bench")
    system(prompts, steps + 1)
    system.engine.profiler = None
    return str(prof.finish())


def peer_systems(args: argparse.Namespace, source: Path, tmp: str, n_ctx: int, threads: int,
                 hf_dtype: str) -> tuple[dict[str, Callable], dict[str, list[int]], list[str]]:
    import torch

    from .peers import LLAMACPP_NOTE, HFSystem, LlamaCppSystem, hf_copy

    systems: dict[str, Callable] = {}
    only: dict[str, list[int]] = {}
    notes: list[str] = []
    if "hf" in args.vs:
        folder = source if source.is_dir() else hf_copy(source, Path(args.hf_dir or Path(tmp) / "hf"))
        systems["hf"] = HFSystem(folder, getattr(torch, hf_dtype), args.device)
        if not source.is_dir():
            notes.append("HF ran the GGUF's weights dequantized by transformers (gguf_file loading)")
    if "llama.cpp" in args.vs:
        systems["llama.cpp"] = LlamaCppSystem(source, n_ctx, threads)
        only["llama.cpp"] = [1]
        notes += [LLAMACPP_NOTE, "llama.cpp (llama-cpp-python's one-sequence API) runs batch 1 only"]
    if args.quant and systems:
        notes.append(f"inferflow quantized the weights at load ({args.quant}); the peers ran the source weights")
    return systems, only, notes


def offline_bench(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    threads = setup_threads(args)
    source = source_of(args)
    model, load_mb = load_ours(source, args)
    dtype = str(model.dtype).replace("torch.", "")
    ids = workload(args, model, max(args.batch))
    prompts = {b: ids[:b] for b in args.batch}
    max_len = max(map(len, ids)) + args.new_tokens + 16
    ours = InferflowSystem(model, max(args.batch), max_len, sum(map(len, ids)), args.kv_cache_dtype)
    with tempfile.TemporaryDirectory(prefix="inferflow-bench-") as tmp:
        peers, only, notes = peer_systems(args, source, tmp, max_len, threads, dtype)
        results = measure({"inferflow": ours, **peers}, prompts, args.new_tokens, args.rounds, batches_of=only,
                          device=args.device, notes=notes)
    out = {"mode": "offline", **header(argv), "notes": notes,
           "config": {"model": str(source), "dtype": dtype, "quant": args.quant, "device": args.device,
                      "batch": args.batch, "prompt_tokens": [len(p) for p in ids], "new_tokens": args.new_tokens,
                      "rounds": args.rounds, "threads": threads, "inferflow_load_rss_mb": load_mb},
           "results": strip_outputs(results), "ratios": ratios(results, "inferflow", list(peers))}
    if args.profile:
        out["profile_trace"] = profile_engine(ours, prompts[min(args.batch)], args.profile, args.profile_steps)
    print_offline(out)
    if args.json:
        write_json(args.json, out)
    if args.plot:
        from .plot import plot_offline

        out["plots"] = [str(p) for p in plot_offline(out["results"], args.plot)]
    return out


def print_offline(out: dict[str, Any]) -> None:
    rows = [[r["system"], r["batch"], r["prefill_tps"], r["decode_tps"], r["decode_ms_per_step"], r["mem_mb"]]
            for r in out["results"]]
    print("\n" + machine_line(out))
    print(md_table(["system", "batch", "prefill tok/s", "decode tok/s", "ms/step", "memory MiB"], rows))
    if out["ratios"]:
        print("\nratios (ours / peer, medians):")
        print(md_table(["peer", "batch", "prefill", "decode", "same greedy tokens"],
                       [[r["peer"], r["batch"], r["prefill_tps"], r["decode_tps"], r["same_greedy_tokens"]]
                        for r in out["ratios"]]))
    for n in out["notes"]:
        print("note:", n)
    if out.get("profile_trace"):
        print("profile trace:", out["profile_trace"])
