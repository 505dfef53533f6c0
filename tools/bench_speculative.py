"""Batch-1 greedy decode with and without speculative decoding, the draft being the model's own first N layers,
or prompt lookup (``ngram`` in ``--draft-layers``: no draft model).

    python tools/bench_speculative.py [--model PATH] [--draft-layers 4,8,10,ngram] [--ngram "1,4;1,4,0"]
        [--spec-tokens 4] [--new-tokens 128] [--prompt-file F] [--chat] [--device cuda --dtype bfloat16]
        [--graph-prefill-tokens 0,128]

Prints tok/s (median of ``--rounds`` after one untimed run; every engine's rounds interleaved) and the engine steps
per generated token: 1.0 means the target accepted no draft token, 1 / (k + 1) that it accepted all.
``--graph-prefill-tokens``: each setting is an engine (on CUDA, 0 runs every speculative pass eagerly, N replays
graphs for passes of up to N new tokens). The model is loaded once. No timing is asserted anywhere.
"""
from __future__ import annotations

import statistics
import time

import inferflow
from inferflow.engine import Engine, EngineConfig, SamplingParams, ngram

import engine_bench_args

DEFAULT_BACKOFF = ngram.MAX_BACKOFF
PROMPT = "The history of the Roman Empire spans many centuries. It began when"


def engine(m, model_path: str, draft: str, k: int, graph_tokens: int, lookup: str,
           kv_gib: float | None = None) -> Engine:
    """``draft``: "0" (no speculation), "ngram:MIN,MAX" (prompt lookup) or N (``model_path``'s first N layers,
    loaded like ``m``)."""
    if draft == "0":
        spec = {}
    elif draft == "ngram":
        lo, hi = map(int, lookup.split(",")[:2])
        spec = {"speculative_model": "[ngram]", "ngram_prompt_lookup_min": lo, "ngram_prompt_lookup_max": hi}
    else:
        spec = {"speculative_model": model_path, "speculative_draft_layers": int(draft)}
    return Engine(m, EngineConfig(max_num_seqs=8, graph_prefill_tokens=graph_tokens, num_speculative_tokens=k,
                                  kv_cache_memory=kv_gib, **spec))


def timed(eng: Engine, prompt: list[int] | str, sp: SamplingParams, backoff: int | None = None) -> tuple[float, int]:
    """Seconds for one request, and the engine steps it took (``backoff``: prompt lookup's MAX_BACKOFF meanwhile)."""
    ngram.MAX_BACKOFF = DEFAULT_BACKOFF if backoff is None else backoff
    t, handle = time.perf_counter(), eng.add_request(prompt, sp)
    steps = sum(1 for _ in handle)
    return time.perf_counter() - t, steps


def main() -> None:
    ap = engine_bench_args.parser(__doc__, rounds=3)
    ap.add_argument("--draft-layers", default="4,8,10")
    ap.add_argument("--spec-tokens", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: the model file's")
    ap.add_argument("--graph-prefill-tokens", default="128", help="comma list: one engine per setting (CUDA)")
    ap.add_argument("--kv-cache-memory", type=float, default=None,
                    help="GiB of K/V per engine (default: 2 on CUDA, where several engines share the GPU)")
    ap.add_argument("--prompt-file", help="the prompt's text (default: a one-line story opening)")
    ap.add_argument("--chat", action="store_true", help="the prompt as a user message in the chat template")
    ap.add_argument("--ngram", default="3,4", help="prompt lookup's shortest and longest n-grams, and optionally its "
                    "MAX_BACKOFF (0: none), one engine each: MIN,MAX[,BACKOFF];...")
    args = ap.parse_args()
    path = engine_bench_args.setup(args)
    m = inferflow.load(path, device=args.device, dtype=args.dtype)
    text = open(args.prompt_file).read() if args.prompt_file else PROMPT
    prompt = m.tokenizer.apply_chat_template([{"role": "user", "content": text}]) if args.chat \
        else m.tokenizer.encode(text)
    kv_gib = args.kv_cache_memory or (2.0 if args.device.startswith("cuda") else None)
    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    engines: dict[str, Engine] = {}
    backoffs: dict[str, int | None] = {}
    for g in map(int, args.graph_prefill_tokens.split(",")):
        for d in ["0", *args.draft_layers.split(",")]:
            for lookup in args.ngram.split(";") if d == "ngram" else [""]:
                what = f"prompt lookup (n = {lookup})" if d == "ngram" else \
                    f"draft = first {d} layers" if d != "0" else "no speculation"
                what = f"graph_prefill_tokens {g}, {what}" + (f", k = {args.spec_tokens}" if d != "0" else "")
                parts = lookup.split(",")
                backoffs[what] = int(parts[2]) if len(parts) > 2 else None
                engines[what] = engine(m, path, d, args.spec_tokens, g, lookup, kv_gib)
                timed(engines[what], prompt, sp, backoffs[what])  # warm-up
    times: dict[str, list[float]] = {w: [] for w in engines}
    steps: dict[str, int] = {}
    for _ in range(args.rounds):  # interleaved: these machines change speed within seconds
        for what, eng in engines.items():
            t, steps[what] = timed(eng, prompt, sp, backoffs[what])
            times[what].append(t)
    base = None
    for what in engines:
        tps = args.new_tokens / statistics.median(times[what])
        base = base or tps
        print(f"{what}: {tps:.1f} tok/s ({tps / base:.2f}x the first), {steps[what] / args.new_tokens:.2f} steps "
              f"per token", flush=True)


if __name__ == "__main__":
    main()
