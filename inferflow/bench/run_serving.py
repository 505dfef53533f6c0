"""``inferflow bench serving``: latency and throughput of a running (or in-process) inferflow-service."""
from __future__ import annotations

import argparse
from typing import Any

from ..errors import InferflowError
from .cli import setup_threads, source_of
from .offline import random_prompts
from .report import header, machine_line, md_table, write_json
from .serving import LocalService, run_serving


def _prompts(args: argparse.Namespace, vocab: int | None, tokenizer: Any) -> list[list[int]]:
    if args.prompts_file:
        from .offline import file_prompts

        if tokenizer is None:
            raise InferflowError("--prompts-file with --url needs --model (its tokenizer)")
        return file_prompts(args.prompts_file, args.num_prompts, tokenizer, args.prompt_len)
    return random_prompts(args.num_prompts, args.prompt_len, vocab or 100, seed=args.seed)


def serving_bench(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    local = None
    url = args.url
    if url is None:
        setup_threads(args)
        local = LocalService(str(source_of(args)), args.dtype, args.device, max_num_seqs=max(args.batch + [8]),
                             profile=args.profile, profile_steps=args.profile_steps)
        url = local.url
    try:
        vocab, tok = None, None
        if local is not None:
            vocab, tok = int(local.served.model.params["vocab_size"]), local.served.tokenizer
        elif args.model:
            import inferflow

            m = inferflow.load(args.model)
            vocab, tok = int(m.params["vocab_size"]), m.tokenizer
        prompts = _prompts(args, vocab, tok)
        res = run_serving(url, prompts, args.new_tokens, model=args.served_model, rate=args.request_rate,
                          arrival=args.arrival, max_concurrency=args.max_concurrency, api_key=args.api_key,
                          slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, seed=args.seed)
    finally:
        if local is not None:
            local.stop()
    out = {"mode": "serving", **header(argv), **res,
           "config": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "max_tokens": args.new_tokens}}
    if args.profile and local is not None:  # the engine writes it when its steps are done or at shutdown
        out["profile_trace"] = str(local.served.engine.profiler.path)
    print_serving(out)
    if args.json:
        write_json(args.json, {k: v for k, v in out.items() if k != "itl_samples_ms"})
    if args.plot:
        from .plot import plot_serving

        out["plots"] = [str(p) for p in plot_serving(out, args.plot)]
    return out


def print_serving(out: dict[str, Any]) -> None:
    print("\n" + machine_line(out))
    print(f"{out['completed']}/{out['requests']} requests in {out['duration_s']:.2f} s; "
          f"{out['request_throughput']:.2f} req/s, {out['output_token_throughput']:.1f} output tok/s, "
          f"{out['total_token_throughput']:.1f} total tok/s, goodput {out['goodput']:.2f} req/s "
          f"(SLO ttft {out['slo']['ttft_ms']} ms, tpot {out['slo']['tpot_ms']} ms)")
    rows = [[k, out[k]["mean"], out[k]["median"], out[k]["p99"]] for k in ("ttft_ms", "tpot_ms", "itl_ms",
                                                                             "e2e_latency_ms")]
    print(md_table(["metric", "mean", "median", "p99"], rows))
    for e in out["errors"]:
        print("error:", e)
