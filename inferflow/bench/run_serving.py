"""``inferflow bench serving``: latency and throughput of a running (or in-process) inferflow-service.

Several ``--request-rate`` values run one after the other against the same service, each with fresh random
prompts (no prefix-cache hit between runs) after its own untimed warm-up on random prompts of its own (with
``--prompts-file`` every run sends the file's first lines again: a later run's prompts are cache hits; with
``--prefix-len`` the prompts of a run share prefixes, another run's do not). With an in-process service the HTTP
client runs in a spawned process of its own (``--client process``), so its 256 streaming threads do not take the
GIL from the engine they measure. ``--doc`` writes the table into the file's ``bench_serving`` section
(``--from-json`` re-renders it from an earlier ``--json`` result without running).
"""
from __future__ import annotations

import argparse
import json
import math
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import InferflowError
from .cli import setup_threads, source_of
from .offline import random_prompts
from .report import header, machine_line, md_table, write_json, write_section

SECTION = "bench_serving"
_ENGINE_ARGS = ("max_num_batched_tokens", "max_model_len", "gpu_memory_utilization", "kv_cache_memory", "kv_cache_dtype")


def _prompts(args: argparse.Namespace, vocab: int | None, tokenizer: Any, seed: int, n: int) -> list[list[int]]:
    if args.prompts_file:
        from .offline import file_prompts

        if tokenizer is None:
            raise InferflowError("--prompts-file with --url needs --model (its tokenizer)")
        return file_prompts(args.prompts_file, n, tokenizer, args.prompt_len)
    prompts = random_prompts(n, args.prompt_len, vocab or 100, seed=seed)
    plen = getattr(args, "prefix_len", 0) or 0
    if plen:  # vLLM's prefix-repetition workload: prompt i starts with shared prefix i % k (a prefix-cache hit)
        if not 0 < plen < args.prompt_len:
            raise InferflowError(f"--prefix-len {plen}: must be between 1 and --prompt-len - 1 ({args.prompt_len - 1})")
        heads = random_prompts(max(1, args.num_prefixes), plen, vocab or 100, seed=seed + 1_000_003)
        prompts = [heads[i % len(heads)] + p[plen:] for i, p in enumerate(prompts)]
    return prompts


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keys given on the command line, for the in-process service."""
    out = {k: v for k in _ENGINE_ARGS if (v := getattr(args, k, None)) is not None and v != "auto"}
    if getattr(args, "no_prefix_caching", False):
        out["enable_prefix_caching"] = False
    return out


def _engine_info(local: Any) -> dict[str, Any]:
    eng, params = local.served.engine, local.served.model.params
    cache = eng.cache
    per_block = cache.bytes_per_block(cache.layers, cache.block_size, cache.dtype)
    return {"max_num_seqs": eng.config.max_num_seqs, "max_num_batched_tokens": eng.config.max_num_batched_tokens,
            "max_model_len": eng.max_model_len, "kv_blocks": cache.num_blocks, "block_size": cache.block_size,
            "kv_cache_gib": cache.num_blocks * per_block / 2 ** 30, "kv_dtype": cache.dtype,
            "device": str(local.served.model.device), "dtype": str(local.served.model.dtype).removeprefix("torch."),
            "shape": {k: params.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                 "num_key_value_heads", "intermediate_size", "vocab_size")}}


def _raise_open_files() -> None:
    """Each request in flight holds two sockets here (client and in-process server): lift the soft limit."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: the default may still do
        pass


def serving_bench(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    if args.from_json:
        out = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        write_section(args.doc, serving_doc(out), SECTION)
        print(f"wrote the {SECTION} section of {args.doc} from {args.from_json}")
        return out
    _raise_open_files()
    local = None
    url = args.url
    if url is None:
        from .serving import LocalService

        setup_threads(args)
        local = LocalService(str(source_of(args)), args.dtype, args.device,
                             max_num_seqs=args.max_num_seqs or max(args.batch + [8]), profile=args.profile,
                             profile_steps=args.profile_steps, engine=engine_overrides(args))
        url = local.url
    pool = None
    try:
        vocab, tok = None, None
        if local is not None:
            vocab, tok = int(local.served.model.params["vocab_size"]), local.served.tokenizer
        elif args.model:
            import inferflow

            m = inferflow.load(args.model)
            vocab, tok = int(m.params["vocab_size"]), m.tokenizer
        if local is not None and args.client == "process":
            import multiprocessing

            pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        runs = []
        for i, rate in enumerate(args.request_rate):
            prompts = _prompts(args, vocab, tok, args.seed + 2 * i, args.num_prompts)
            # random ids even with --prompts-file (whose lines the timed prompts are: a warm-up on them would leave
            # every timed prompt a prefix-cache hit)
            warm = random_prompts(args.warmup_requests, args.prompt_len, vocab or 100, seed=args.seed + 2 * i + 1) \
                if args.warmup_requests else None
            kw = dict(model=args.served_model, rate=rate, arrival=args.arrival, max_concurrency=args.max_concurrency,
                      api_key=args.api_key, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                      seed=args.seed + i, warmup=False, warmup_prompts=warm,
                      warmup_tokens=args.warmup_tokens)
            from .serving import run_serving

            res = pool.submit(run_serving, url, prompts, args.new_tokens, **kw).result() if pool else \
                run_serving(url, prompts, args.new_tokens, **kw)
            runs.append(res)
            print_run(res)
            if args.json and len(runs) < len(args.request_rate):  # what is done survives a later run's timeout
                write_json(args.json, _result(args, argv, runs, local))
    finally:
        if pool is not None:
            pool.shutdown()
        if local is not None:
            local.stop()
    out = _result(args, argv, runs, local)
    print_serving(out)
    if args.json:
        write_json(args.json, out)
    if args.doc:
        write_section(args.doc, serving_doc(out), SECTION)
    if args.plot:
        from .plot import plot_serving

        out["plots"] = [str(p) for p in plot_serving({**out, "itl_samples_ms": runs[0].get("itl_samples_ms", [])},
                                                      args.plot)]
    return out


def _result(args: argparse.Namespace, argv: list[str], runs: list[dict[str, Any]], local: Any) -> dict[str, Any]:
    """The JSON record: the first run's figures at the top level (every run under ``runs`` when several)."""
    out = {"mode": "serving", **header(argv), **{k: v for k, v in runs[0].items() if k != "itl_samples_ms"},
           "config": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "max_tokens": args.new_tokens,
                      "prefix_len": getattr(args, "prefix_len", 0), "num_prefixes": getattr(args, "num_prefixes", 1),
                      "request_rates": args.request_rate, "warmup_requests": args.warmup_requests,
                      "warmup_tokens": args.warmup_tokens,
                      "client": args.client if local is not None else "thread"}}
    if len(args.request_rate) > 1:
        out["runs"] = [{k: v for k, v in r.items() if k != "itl_samples_ms"} for r in runs]
    if local is not None:
        out["engine"] = _engine_info(local)
    if args.profile and local is not None:  # the engine writes it when its steps are done or at shutdown
        out["profile_trace"] = str(local.served.engine.profiler.path)
    return out


def _rate(r: float | str) -> str:
    return "all at once" if math.isinf(float(r)) else f"{float(r):g} req/s"


def print_run(r: dict[str, Any]) -> None:
    print(f"rate {_rate(r['rate'])}: {r['completed']}/{r['requests']} requests in {r['duration_s']:.2f} s; "
          f"{r['output_token_throughput']:.1f} output tok/s; TTFT median {r['ttft_ms']['median']:.1f} ms",
          flush=True)


def print_serving(out: dict[str, Any]) -> None:
    print("\n" + machine_line(out))
    for r in out.get("runs", [out]):
        print(f"{_rate(r['rate'])}: {r['completed']}/{r['requests']} requests in {r['duration_s']:.2f} s; "
              f"{r['request_throughput']:.2f} req/s, {r['output_token_throughput']:.1f} output tok/s, "
              f"{r['total_token_throughput']:.1f} total tok/s, goodput {r['goodput']:.2f} req/s "
              f"(SLO ttft {r['slo']['ttft_ms']} ms, tpot {r['slo']['tpot_ms']} ms)")
        rows = [[k, r[k]["mean"], r[k]["median"], r[k]["p99"]] for k in ("ttft_ms", "tpot_ms", "itl_ms",
                                                                         "e2e_latency_ms")]
        print(md_table(["metric", "mean", "median", "p99"], rows))
        for e in r["errors"]:
            print("error:", e)


def serving_doc(out: dict[str, Any]) -> str:
    """The ``bench_serving`` docs section: setup, command, machine, one row per request rate."""
    cfg, eng = out["config"], out.get("engine")
    shared = (f" (the first {cfg['prefix_len']} shared: {cfg.get('num_prefixes', 1)} prefix(es))"
              if cfg.get("prefix_len") else "")
    lines = [f"### Serving benchmark: {cfg['num_prompts']} requests, {cfg['prompt_len']}-token prompts{shared}, "
             f"{cfg['max_tokens']} output tokens ({out['date'][:10]})", ""]
    if eng:
        sh = eng["shape"]
        lines.append(f"In-process inferflow-service on {eng['device']} ({eng['dtype']}), model: hidden "
                     f"{sh['hidden_size']}, {sh['num_hidden_layers']} layers, {sh['num_attention_heads']} q / "
                     f"{sh['num_key_value_heads']} kv heads, intermediate {sh['intermediate_size']}, vocab "
                     f"{sh['vocab_size']}; engine: max_num_seqs {eng['max_num_seqs']}, max_num_batched_tokens "
                     f"{eng['max_num_batched_tokens']}, KV cache {eng['kv_blocks']} blocks of {eng['block_size']} "
                     f"tokens ({eng['kv_cache_gib']:.2f} GiB, {eng['kv_dtype']}). HTTP client: "
                     f"{'a process of its own' if cfg.get('client') == 'process' else 'threads of the same process'}.")
    lines.append("Streamed `/v1/completions` with token-id prompts, greedy, EOS ignored; TTFT from the request's "
                 "send to its first streamed text, TPOT = (latency - TTFT) / (tokens - 1), ITL = gaps between "
                 f"streamed chunks; before each run {cfg.get('warmup_requests', 1)} untimed warm-up request(s) of "
                 f"{cfg.get('warmup_tokens', 2)} tokens on prompts of their own.")
    lines += ["", machine_line(out), "", "```bash", out["command"], "```", ""]
    rows = []
    for r in out.get("runs", [out]):
        t, p, it = r["ttft_ms"], r["tpot_ms"], r["itl_ms"]
        rows.append([_rate(r["rate"]) + (f", {r['arrival']}" if not math.isinf(float(r["rate"])) else ""),
                     f"{r['completed']}/{r['requests']}", r["duration_s"], r["request_throughput"],
                     f"{r['output_token_throughput']:,.0f}", f"{r['total_token_throughput']:,.0f}",
                     f"{t['median']:,.0f} / {t['p99']:,.0f}", f"{p['median']:.1f} / {p['p99']:.1f}",
                     f"{it['median']:.1f} / {it['p99']:.1f}"])
    lines.append(md_table(["arrivals", "completed", "duration s", "req/s", "output tok/s", "total tok/s",
                           "TTFT ms median / p99", "TPOT ms median / p99", "ITL ms median / p99"], rows))
    return "\n".join(lines)
