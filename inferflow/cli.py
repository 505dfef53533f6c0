"""Command-line entry points: ``inferflow`` (tools), ``llm_inference`` (query files)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .errors import InferflowError

QUERY_DIR = Path(__file__).resolve().parent / "data"


def _default_query_file() -> Path:
    for cand in (QUERY_DIR / "query.yaml", Path(__file__).resolve().parent.parent / "service_configs" / "query.yaml"):
        if cand.is_file():
            return cand
    raise InferflowError("no default query file shipped (expected service_configs/query.yaml)")


def _load_model(cfg: dict[str, Any]):
    import inferflow

    source = cfg.get("source")
    if not source:
        from .default_model import default_model_path

        source = default_model_path()
    return inferflow.load(source, spec=cfg.get("spec"), dtype=cfg.get("dtype"), device=cfg.get("device"))


def _prompt_ids(model, query: dict[str, Any] | str, use_chat: bool) -> list[int]:
    if isinstance(query, str):
        query = {"text": query}
    tok = model.tokenizer
    if use_chat and tok is not None and tok.chat_template:
        messages = []
        if query.get("system_prompt"):
            messages.append({"role": "system", "content": query["system_prompt"]})
        messages.append({"role": "user", "content": query.get("text", "")})
        text = tok.apply_chat_template(messages, add_generation_prompt=True) + query.get("res_prefix", "")
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(query.get("text", "") + query.get("res_prefix", ""))


def llm_inference_main(argv: list[str] | None = None) -> int:
    """Run the queries of a query file (YAML or JSON) and print the results and throughput."""
    import yaml

    ap = argparse.ArgumentParser(prog="llm_inference", description=llm_inference_main.__doc__)
    ap.add_argument("query_file", nargs="?", help="query file (default: the shipped one, on the default model)")
    args = ap.parse_args(argv)
    path = Path(args.query_file) if args.query_file else _default_query_file()
    try:
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        model_cfg = cfg.get("model", {})
        sampling = cfg.get("sampling", {})
        model = _load_model(model_cfg)
        use_chat = model_cfg.get("chat", True)
        total_tokens, t0 = 0, time.perf_counter()
        for n, query in enumerate(cfg.get("queries", []), 1):
            ids = _prompt_ids(model, query, use_chat)
            out = model.generate_ids(ids, max_new_tokens=sampling.get("max_new_tokens", 128),
                                     temperature=sampling.get("temperature", 0.0), top_k=sampling.get("top_k", 0),
                                     top_p=sampling.get("top_p", 1.0), seed=sampling.get("seed"))
            total_tokens += len(out)
            text = query if isinstance(query, str) else query.get("text", "")
            print(f"===== Query {n}: {text}")
            print(model.tokenizer.decode(out))
        dt = time.perf_counter() - t0
        if total_tokens:
            print(f"Time per token: {1000 * dt / total_tokens:.2f} ms ({dt:.2f}s / {total_tokens})")
            print(f"Throughput: {total_tokens / dt:.2f} tokens/sec")
    except (InferflowError, OSError, yaml.YAMLError) as e:
        print(f"llm_inference: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """``inferflow`` tool: list specs and components, inspect model files, generate text."""
    ap = argparse.ArgumentParser(prog="inferflow")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("specs", help="list the model specs on the search path")
    sub.add_parser("components", help="list registered components")
    g = sub.add_parser("generate", help="generate a continuation of a prompt")
    g.add_argument("prompt")
    g.add_argument("--model", help="model folder or file (default: the embedded default model)")
    g.add_argument("--spec")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    ins = sub.add_parser("inspect", help="describe a model file or folder without loading its weights")
    ins.add_argument("source", help="model file or folder")
    ins.add_argument("--spec", help="spec name or path (default: auto-detected)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "specs":
            from .spec.loader import all_specs

            for s in all_specs():
                m = s.data.get("match", {})
                print(f"{s.name:14s} {s.architecture:16s} {json.dumps(m.get('hf_model_type', []))}  {s.file}")
        elif args.cmd == "components":
            from . import registry

            print("\n".join(registry.names()))
        elif args.cmd == "generate":
            model = _load_model({"source": args.model, "spec": args.spec})
            print(model.generate(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, top_p=args.top_p, seed=args.seed))
        elif args.cmd == "inspect":
            from .inspect import inspect_main

            return inspect_main(args.source, args.spec)
    except InferflowError as e:
        print(f"inferflow: {e}", file=sys.stderr)
        return 2
    return 0


def service_main(argv: list[str] | None = None) -> int:
    """``inferflow-service``: the HTTP service (native and OpenAI routes) is built in the service issue."""
    print("inferflow-service: the HTTP service is not part of this release yet", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
