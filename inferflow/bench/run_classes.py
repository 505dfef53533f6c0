"""``inferflow bench --classes f32,f16,q8_0,q4_0``: per precision class, the same GGUF file run by inferflow and
llama.cpp at batch 1 (decode and prefill tok/s) and by inferflow and HF transformers at the largest batch
(aggregate decode tok/s); ``--doc FILE`` writes the table into FILE's ``<!-- bench_cpu -->`` section."""
from __future__ import annotations

import argparse
import gc
from pathlib import Path
from typing import Any, Callable

from .cli import setup_threads, source_of, strip_outputs
from .ladder import CLASSES, HF_CLASSES, class_files
from .offline import InferflowSystem, measure, ratios
from .report import header, machine_line, md_table, write_json, write_section
from .run_offline import load_ours, profile_engine, workload

MARKER = "bench_cpu"


def classes_bench(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    import torch

    threads = setup_threads(args)
    source = source_of(args)
    names = [c.strip() for c in args.classes.split(",") if c.strip()]
    work = Path(args.work_dir)
    files = class_files(source, work, [c for c in names if c != "file"])
    if "file" in names:
        files["file"] = source
    big = max(args.batch)
    out: dict[str, Any] = {"mode": "classes", **header(argv), "classes": {}, "notes": []}
    for c in names:
        dtype = CLASSES[c][0] if c in CLASSES else "float32"
        model, load_mb = load_ours(files[c], args, dtype)
        ids = workload(args, model, big)
        prompts = {b: ids[:b] for b in sorted({1, big})}
        max_len = args.prompt_len + args.new_tokens + 16
        ours = InferflowSystem(model, big, max_len, sum(map(len, ids)), args.kv_cache_dtype)
        systems: dict[str, Callable] = {"inferflow": ours}
        only: dict[str, list[int]] = {}
        if "llama.cpp" in args.vs:
            from .peers import LLAMACPP_NOTE, LlamaCppSystem

            systems["llama.cpp"], only["llama.cpp"] = LlamaCppSystem(files[c], max_len, threads), [1]
            if LLAMACPP_NOTE not in out["notes"]:
                out["notes"].append(LLAMACPP_NOTE)
        if "hf" in args.vs and c in HF_CLASSES and big > 1:
            from .peers import HFSystem, hf_copy

            folder = hf_copy(files["f32"] if "f32" in files else files[c], work / f"{source.stem}.hf")
            systems["hf"], only["hf"] = HFSystem(folder, getattr(torch, HF_CLASSES[c]), args.device), [big]
        if "hf" not in systems:  # the large batch is only measured against HF
            only["inferflow"] = [1]
        print(f"== class {c}: {files[c].name} (inferflow {dtype}) ==")
        dropped: list[str] = []
        res = measure(systems, prompts, args.new_tokens, args.rounds, batches_of=only, device=args.device,
                      notes=dropped)
        out["notes"] += [f"{c}: {d}" for d in dropped]
        out["classes"][c] = {"file": str(files[c]), "inferflow_dtype": dtype, "inferflow_load_rss_mb": load_mb,
                             "results": strip_outputs(res), "ratios": ratios(res, "inferflow",
                                                                             [s for s in systems if s != "inferflow"])}
        if args.profile and c == names[0]:
            out["profile_trace"] = profile_engine(ours, prompts[1], args.profile, args.profile_steps)
        del systems, ours, model
        gc.collect()
        text = finish(out, args, threads, source)  # after every class: a later crash keeps the rows so far
    print("\n" + text)
    if args.doc:
        print(f"wrote the <!-- {MARKER} --> section of {args.doc}")
    return out


def finish(out: dict[str, Any], args: argparse.Namespace, threads: int, source: Path) -> str:
    out["config"] = {"model": str(source), "batch": [1, max(args.batch)], "prompt_len": args.prompt_len,
                     "new_tokens": args.new_tokens, "rounds": args.rounds, "threads": threads,
                     "kv_cache_dtype": args.kv_cache_dtype}
    text = render(out, args)
    if args.json:
        write_json(args.json, out)
    if args.doc:
        write_section(args.doc, text, MARKER)
    return text


def render(out: dict[str, Any], args: argparse.Namespace) -> str:
    big = max(args.batch)
    rows = []
    for c, r in out["classes"].items():
        by = {(x["system"], x["batch"]): x for x in r["results"]}
        ours1, lc = by.get(("inferflow", 1)), by.get(("llama.cpp", 1))
        oursb, hf = by.get(("inferflow", big)), by.get(("hf", big))
        ratio = lambda a, b, k: a[k] / b[k] if a and b and b[k] else None  # noqa: E731
        get = lambda a, k: a[k] if a else None  # noqa: E731
        label = CLASSES[c][2] if c in CLASSES else f"file as-is ({Path(r['file']).name})"
        rows.append([label, get(ours1, "decode_tps"), get(lc, "decode_tps"), ratio(ours1, lc, "decode_tps"),
                     get(ours1, "prefill_tps"), get(lc, "prefill_tps"), ratio(ours1, lc, "prefill_tps"),
                     get(oursb, "decode_tps"), get(hf, "decode_tps"), ratio(oursb, hf, "decode_tps")])
    table = md_table(["precision (ours vs llama.cpp)", "decode tok/s ours", "llama.cpp", "ratio",
                      "prefill tok/s ours", "llama.cpp", "ratio", f"batch {big} decode ours", "HF", "ratio"], rows)
    cfg = out["config"]
    return "\n".join([
        f"## CPU: inferflow vs llama.cpp and HF transformers ({out['date'][:10]})", "",
        machine_line(out), "",
        f"Model: {Path(cfg['model']).name} and GGUFs written from it (f32: dequantized with gguf-py; f16, q8_0, q4_0: "
        f"llama.cpp's quantizations of the f32 file), each run as-is by inferflow (in the listed precision) and by "
        f"llama.cpp; inferflow's K/V cache: {cfg.get('kv_cache_dtype', 'auto')} (auto: the model's dtype; llama.cpp's "
        f"is f16, HF's the model's dtype). Batch 1: a {cfg['prompt_len']}-token random prompt, {cfg['new_tokens']} new tokens, greedy, "
        f"EOS ignored; prefill tok/s = prompt tokens / time to the first token, decode tok/s = later tokens / "
        f"their time. Batch {big}: aggregate decode tok/s of {big} such requests, inferflow's engine vs HF "
        f"`generate` on the f32 file's weights (dequantized by transformers; float classes only). The machine is "
        f"shared and noisy (other jobs run on the same cores): the systems run interleaved (each once per round), "
        f"the figures are medians of {cfg['rounds']} rounds, and only the ratios within a row are meaningful. "
        + ". ".join(out["notes"]) + ".", "",
        "```bash", out["command"].replace("inferflow bench", "python tools/bench.py", 1), "```", "",
        table, ""])
