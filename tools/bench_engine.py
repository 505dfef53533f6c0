"""Decode throughput of inferflow's Engine against HF transformers ``generate``, at several concurrencies.

Kept for the ``bench_engine`` section of docs/benchmarks.md; the general tool is ``inferflow bench`` (tools/bench.py:
batch sizes, prefill and decode, memory, ``--vs hf`` / ``--vs llama.cpp``, serving latency, plots, profiles),
which shares this script's HF copy (inferflow/bench/peers.py) and section writer.

    python tools/bench_engine.py [--concurrency 1,8,32] [--max-new-tokens 32] [--rounds 2] [--device cpu|cuda]
                                 [--dtype float32] [--model PATH] [--hf-dir DIR] [--threads N]
                                 [--write docs/benchmarks.md]

Models: the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) as inferflow loads it (packed blocks), and an
HF-layout copy of it (the GGUF dequantized by transformers, saved as safetensors + config.json; ``--hf-dir`` keeps
it between runs). The HF baseline is ``generate`` on that copy (transformers runs a GGUF only dequantized), greedy,
the same prompts and max_new_tokens, the batch left-padded; for every concurrency both systems run the same
prompts with EOS ignored, so every request produces exactly max_new_tokens tokens.

Decode tokens/s = tokens generated after each request's first one / time from the first token to the end: the
prefill (and the first token) is left out, as a serving engine's decode rate. The machine's speed drifts (a shared
VM: up to 45% within seconds), so each round runs every system once per concurrency, interleaved, and the table
shows medians over rounds. "same" counts requests whose greedy tokens equal HF's (float numerics can flip a
near-tie; the quantized GGUF is expected to differ from the dequantized float model).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import inferflow  # noqa: E402
from inferflow.bench.offline import InferflowSystem  # noqa: E402
from inferflow.bench.peers import HFSystem, hf_copy  # noqa: E402,F401 - shared with inferflow bench
from inferflow.bench.report import write_section as _write_section  # noqa: E402

BEGIN, END = "<!-- bench_engine -->", "<!-- /bench_engine -->"
PROMPTS = [
    "The capital of France is", "Write a short poem about the sea.", "Explain photosynthesis in simple terms.",
    "List three uses of a paperclip:", "Once upon a time, in a small village,", "What is 17 times 23?",
    "Translate 'good morning' into Spanish.", "Give me a recipe for pancakes.", "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.", "def fibonacci(n):", "The best way to learn a language is",
    "Describe a cat to someone who has never seen one.", "Name the planets of the solar system.",
    "How do airplanes stay in the air?", "Write a haiku about autumn leaves.", "What makes a good friend?",
    "The history of the printing press begins", "Suggest a name for a coffee shop.", "How does a refrigerator work?",
    "Tell me a fun fact about octopuses.", "In 1969, astronauts", "What are the benefits of regular exercise?",
    "Compose a limerick about a programmer.", "Explain recursion with an example.", "The recipe calls for",
    "Why do leaves change color in the fall?", "Write the opening line of a mystery novel.",
    "What is the difference between weather and climate?", "A good breakfast includes",
    "How many legs does a spider have?", "Describe the sound of rain on a tin roof.",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated numbers of concurrent requests")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the table shows medians")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, help="float32 (CPU default), bfloat16, float16")
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the embedded default model)")
    ap.add_argument("--hf-dir", default=None, help="where the HF-layout copy of a GGUF is kept (reused if present)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--write", default=None, metavar="MARKDOWN", help=f"replace the {BEGIN} section of this file")
    args = ap.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    except ValueError:
        ap.error(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1 or args.max_new_tokens < 2 or args.rounds < 1:
        ap.error("--concurrency values and --rounds must be >= 1, --max-new-tokens >= 2")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return args


def prompt_ids(model: Any, n: int) -> list[list[int]]:
    """``n`` prompts as token ids (the model's tokenizer; synthetic ids for tokenizer-less test models)."""
    tok = model.tokenizer
    if tok is None:
        vocab = int(model.params["vocab_size"])
        return [[3 + (7 * i + 5 * j) % (vocab - 3) for j in range(4 + i % 9)] for i in range(n)]
    return [tok.encode(PROMPTS[i % len(PROMPTS)]) for i in range(n)]


class _TpsOf:
    """A system of `inferflow bench` (inferflow/bench) as this tool's runner: decode tok/s and the token ids."""

    def __init__(self, system: Any):
        self.system = system

    def __call__(self, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
        s = self.system(prompts, n)
        return s.decode_tps, s.outputs


def InferflowRun(model: Any, max_seqs: int, max_len: int, device: str) -> _TpsOf:
    """One Engine per model, reused across rounds; prefix caching off so every round prefills again."""
    return _TpsOf(InferflowSystem(model, max_seqs, max_len, max_len * max_seqs))


def HFRun(folder: Path, dtype: str, device: str) -> _TpsOf:
    """transformers ``generate``: greedy, batched with left padding, EOS off (exactly n new tokens)."""
    return _TpsOf(HFSystem(folder, getattr(torch, dtype), device))


def measure(systems: dict[str, Callable], prompts: dict[int, list[list[int]]], n: int, rounds: int,
            log: Callable[[str], None] = print) -> dict[tuple[str, int], dict[str, Any]]:
    """Interleaved rounds: every system at every concurrency once per round; medians and the last outputs."""
    samples: dict[tuple[str, int], list[float]] = {}
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    for name, run in systems.items():  # warm-up (allocator, kernels, lazy imports)
        run(prompts[min(prompts)], 2)
    for r in range(rounds):
        for c, ps in prompts.items():
            for name, run in systems.items():
                tps, outs = run(ps, n)
                samples.setdefault((name, c), []).append(tps)
                outputs[(name, c)] = outs
                log(f"round {r + 1}/{rounds}  c={c:<3} {name:<16} {tps:8.1f} tok/s")
    return {k: {"tps": statistics.median(v), "samples": v, "outputs": outputs[k]} for k, v in samples.items()}


def table(results: dict, labels: dict[str, str], concurrency: list[int]) -> str:
    """Markdown table: one row per (inferflow model, concurrency) against HF at that concurrency."""
    lines = ["| config | inferflow tok/s | HF tok/s | ratio | same tokens as HF |", "|---|---:|---:|---:|---:|"]
    for name, label in labels.items():
        for c in concurrency:
            ours, ref = results[(name, c)], results[("hf", c)]
            same = sum(a == b for a, b in zip(ours["outputs"], ref["outputs"]))
            lines.append(f"| {label}, {c} concurrent | {ours['tps']:.1f} | {ref['tps']:.1f} | "
                         f"{ours['tps'] / ref['tps']:.2f} | {same}/{c} |")
    return "\n".join(lines)


def write_section(path: Path, body: str) -> None:
    """Replace the text between the markers (inclusive) with ``body`` wrapped in them; append when absent."""
    _write_section(path, body, BEGIN[5:-4])


def report(args: argparse.Namespace, argv: list[str], results: dict, labels: dict[str, str], model_name: str,
           prompt_lens: list[int]) -> str:
    import transformers

    cmd = "python tools/bench_engine.py" + "".join(" " + shlex.quote(a) for a in argv)
    when = datetime.date.today().isoformat()
    where = (torch.cuda.get_device_name() if args.device == "cuda" else
             f"{os.cpu_count()} CPU cores ({platform.machine()}), {torch.get_num_threads()} torch threads")
    return "\n".join([
        f"## Engine decode throughput vs HF transformers ({when})", "",
        f"{where}; torch {torch.__version__}, transformers {transformers.__version__}. Model: {model_name}; "
        f"{args.dtype}; greedy, {args.max_new_tokens} new tokens per request (EOS ignored), prompts of "
        f"{min(prompt_lens)}-{max(prompt_lens)} tokens. Decode tokens/s = tokens after each request's first / time "
        f"after the first token (prefill excluded); medians of {args.rounds} rounds, the systems interleaved within "
        f"each round. HF: `generate` on the HF-layout copy (float weights dequantized from the GGUF), batched with "
        f"left padding. Ratio = inferflow / HF.", "",
        "```bash", cmd, "```", "",
        table(results, labels, args.concurrency), ""])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model is None:
        from inferflow.default_model import default_model_path

        source = default_model_path()
    else:
        source = Path(args.model)
    systems: dict[str, Callable] = {}
    labels: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="inferflow-bench-") as tmp:
        if source.is_file() and source.suffix == ".gguf":
            hf_dir = hf_copy(source, Path(args.hf_dir) if args.hf_dir else Path(tmp) / "hf")
            first = inferflow.load(source, dtype=args.dtype, device=args.device)
            labels["inferflow-gguf"] = f"GGUF ({source.name})"
        else:
            hf_dir, first = source, None
        hf_model = inferflow.load(hf_dir, dtype=args.dtype, device=args.device)
        ids = prompt_ids(first or hf_model, max(args.concurrency))
        prompts = {c: ids[:c] for c in args.concurrency}
        max_len = max(len(p) for p in ids) + args.max_new_tokens + 8
        if first is not None:
            systems["inferflow-gguf"] = InferflowRun(first, max(args.concurrency), max_len, args.device)
        systems["inferflow-hf"] = InferflowRun(hf_model, max(args.concurrency), max_len, args.device)
        labels["inferflow-hf"] = "HF-layout copy"
        systems["hf"] = HFRun(hf_dir, args.dtype, args.device)
        results = measure(systems, prompts, args.max_new_tokens, args.rounds)
    text = report(args, argv, results, labels, source.name, [len(p) for p in ids])
    print("\n" + text)
    if args.write:
        write_section(Path(args.write), text)
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
