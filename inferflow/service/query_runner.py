"""``llm_inference``: every query of a query file submitted to the engine at once (continuous batching), the first
streamed to the terminal as it is generated, then each other result, then time per token and throughput."""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, TextIO

from ..engine.sampling_params import SamplingParams
from ..errors import InferflowError
from .decoding_alg import strategy_params
from .query_file import QueryJob


def job_params(job: QueryJob, served: Any, max_new_tokens: int | None = None) -> SamplingParams:
    """The job's sampling section (``decoding_alg`` and ``max_new_tokens`` spellings too) over the model's defaults."""
    s = dict(job.sampling)
    alg = s.pop("decoding_alg", None)
    if "max_new_tokens" in s:
        s["max_tokens"] = s.pop("max_new_tokens")
    if max_new_tokens is not None:
        s["max_tokens"] = max_new_tokens
    kw = {**served.cfg.sampling, **strategy_params(alg), **s}
    kw.setdefault("max_tokens", 300)  # Inferflow's llm_inference cap
    try:
        return SamplingParams(**kw)
    except TypeError as e:
        raise InferflowError(f"sampling: {e}") from None


def _show(query: dict[str, str]) -> str:
    text = query.get("text", "")
    return text if len(text) <= 200 else text[:197] + "..."


def run_job(job: QueryJob, served: Any, out: TextIO | None = None, max_new_tokens: int | None = None) -> int:
    """Run the queries; returns the number of generated tokens."""
    out = out or sys.stdout
    from .native_routes import native_prompt

    if not served.generates:
        return _embed_job(job, served, out)
    base = job_params(job, served, max_new_tokens)
    handles = []
    t0 = time.perf_counter()
    for q in job.queries:
        ids, encoder = native_prompt(served, q, use_chat=job.chat)
        if len(ids) >= served.max_model_len:
            raise InferflowError(f"query {len(handles) + 1}: the prompt has {len(ids)} tokens; the model's context "
                                 f"is {served.max_model_len} tokens")
        params = dataclasses.replace(base, max_tokens=served.fit_max_tokens(len(ids), base.max_tokens, "prompt",
                                                                            clip=True))
        handles.append(served.engine.add_request(ids, params, encoder_prompt=encoder))
    print(f"Query 1: {_show(job.queries[0])}", file=out)
    print("Inference results:", file=out)
    first = None
    for delta in handles[0]:  # stepping the engine here also advances every other query
        out.write(delta.outputs[0].delta_text)
        out.flush()
        first = delta
    print(f"\n[end: {first.outputs[0].finish_reason}]", file=out)
    results = [first]
    if len(handles) > 1:
        print("Waiting for other queries to complete...", file=out)
    for i, h in enumerate(handles[1:], 2):
        r = h.result()
        results.append(r)
        print(f"===== Results of query {i}: {_show(job.queries[i - 1])}", file=out)
        print(r.outputs[0].text, file=out)
        print(f"[end: {r.outputs[0].finish_reason}]", file=out)
    elapsed = time.perf_counter() - t0
    errors = [f"query {i}: {r.error}" for i, r in enumerate(results, 1) if r.error]
    if errors:
        raise InferflowError("; ".join(errors))
    tokens = sum(len(o.token_ids) for r in results for o in r.outputs)
    if tokens:
        print(f"Time per token: {1000 * elapsed / tokens:.2f} ms ({elapsed:.2f}s / {tokens})", file=out)
        print(f"Throughput: {tokens / elapsed:.2f} tokens/sec", file=out)
    return tokens


def _embed_job(job: QueryJob, served: Any, out: TextIO) -> int:
    t0 = time.perf_counter()
    vectors = served.engine.embed([q.get("text", "") for q in job.queries])
    elapsed = time.perf_counter() - t0
    for i, (q, v) in enumerate(zip(job.queries, vectors), 1):
        head = ", ".join(f"{x:.4f}" for x in v[:6].tolist())
        print(f"===== Embedding of query {i}: {_show(q)}\n[{head}, ...] (dim {v.shape[-1]})", file=out)
    print(f"Time: {elapsed:.2f}s for {len(job.queries)} queries", file=out)
    return 0


def llm_inference(argv: list[str] | None = None) -> int:
    """Run the queries of a query file (YAML, or Inferflow's llm_inference.ini) batched through the engine."""
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="llm_inference", description=llm_inference.__doc__)
    ap.add_argument("query_file", nargs="?", help="query file (default: the shipped one, on the default model)")
    ap.add_argument("--max-new-tokens", type=int, help="override the file's output length cap")
    args = ap.parse_args(argv)
    try:
        from .progress import LoadBar
        from .query_file import load_query_file
        from .served_model import ServedModel, load_model

        path = Path(args.query_file) if args.query_file else Path(__file__).resolve().parent.parent / "data" / \
            "query.yaml"
        job = load_query_file(path)
        from ..parallel.launch import launched_world, world_of

        if world_of(job.model) > 1 or launched_world() > 1:  # one process per rank; rank 0 prints (placement)
            from ..parallel.launch import run_job_parallel

            return run_job_parallel(job, lambda served: run_job(job, served, max_new_tokens=args.max_new_tokens),
                                    ["llm_inference", *(sys.argv[1:] if argv is None else argv)])
        with LoadBar(f"Loading {job.model.source or 'the default model'}") as bar:
            model = load_model(job.model, progress=bar)
        served = ServedModel(job.model, model)
        run_job(job, served, max_new_tokens=args.max_new_tokens)
    except (InferflowError, OSError) as e:
        print(f"llm_inference: {e}", file=sys.stderr)
        return 2
    return 0
