"""Command-line entry points: ``inferflow`` (tools, chat), ``llm_inference`` (query files), ``inferflow-service``."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .errors import InferflowError


def _load_model(cfg: dict[str, Any]):
    import inferflow

    source = cfg.get("source")
    if not source:
        from .default_model import default_model_path

        source = default_model_path()
    return inferflow.load(source, spec=cfg.get("spec"), dtype=cfg.get("dtype"), device=cfg.get("device"))


def _as_script(argv: list[str] | None) -> None:
    # a console script (argv None) owns its process: what the imports made is long-lived (inferflow.freeze_heap);
    # in-process calls with an argv (tests) leave the collector alone
    if argv is None:
        from . import freeze_heap

        freeze_heap()


def llm_inference_main(argv: list[str] | None = None) -> int:
    """Run the queries of a query file (YAML, or Inferflow's llm_inference.ini) batched through the engine."""
    _as_script(argv)
    from .service.query_runner import llm_inference

    return llm_inference(argv)


def main(argv: list[str] | None = None) -> int:
    """``inferflow`` tool: list specs and components, inspect model files, generate text, chat."""
    _as_script(argv)
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
    sub.add_parser("chat", help="interactive terminal chat (see: inferflow chat --help)", add_help=False)
    sub.add_parser("quantize", help="write a quantized model (see: inferflow quantize --help)", add_help=False)
    sub.add_parser("llm_inference", help="run a query file (see: llm_inference --help)", add_help=False)
    sub.add_parser("perplexity", help="sliding-window perplexity on a text (see: inferflow perplexity --help)",
                   add_help=False)
    sub.add_parser("bench", help="throughput / latency benchmarks (see: inferflow bench --help)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["chat"]:  # its own options: parsed by chat_main
        from .service.chat_cli import chat_main

        return chat_main(argv[1:])
    if argv[:1] == ["llm_inference"]:  # ``python -m inferflow.cli llm_inference q.yaml`` (torchrun launches this)
        return llm_inference_main(argv[1:])
    if argv[:1] == ["quantize"]:  # its own options: inferflow/quant/cli.py
        from .quant.cli import quantize_main

        return quantize_main(argv[1:])
    if argv[:1] == ["bench"]:  # its own options: inferflow/bench/cli.py
        from .bench.cli import bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["perplexity"]:  # its own options: inferflow/eval/perplexity.py
        from .eval.perplexity import perplexity_main

        return perplexity_main(argv[1:])
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
    """``inferflow-service [service.yaml]``: the HTTP service (native and OpenAI routes)."""
    _as_script(argv)
    from .service.cli import service_main as run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
