"""GPU fast-path benchmark: inferflow's engine against HF transformers' static-cache + torch.compile path, in one run.

    python tools/bench_gpu.py [--out DIR] [--rounds 3] [--budget 420] [--q4] [--tiny]

Model: a Qwen3-8B-shaped decoder (hidden 4096, 36 layers, 32 q / 8 kv heads of 128, intermediate 12288, vocab
151936, q/k norm) with random bf16 weights, built on the GPU by transformers; inferflow loads the same tensors
through an in-memory weight source (no 16 GB file written). Measured, every system interleaved per round, medians:
- decode tok/s at batch 1 and 64 (128-token prompts, 128 new tokens, EOS ignored; tokens after each request's
  first / time after the first token): inferflow's Engine (CUDA graphs, paged Triton attention, fused
  projections) vs HF ``StaticCache`` + ``torch.compile(mode="reduce-overhead")`` greedy decode steps;
- prefill tok/s of 2048-token prompts: the Engine (16 prompts, max_tokens=1) vs HF's static-cache path (the
  eager forward of 4 x 2048 tokens into a ``StaticCache``, as ``generate`` runs a prompt) and vs HF's plain eager
  forward without a cache (its fastest prefill); logits of the last position only;
- q4 decode (``--q4``: load-time 4.5-bit quantization, ``--q4-format q4_0`` by default, through the quantization
  helper's Triton kernels) at batch 1 and 64, interleaved with bf16 decode in the same phase (run last: inferflow's
  searched ``q4`` format takes minutes to quantize 8B parameters, seen on the H200: > 5 minutes).
Correctness: last-position logits of 4 prompts (inferflow vs HF: max |diff| / max |ref|, top-1 agreement), greedy
tokens of the decode runs (leading tokens equal to HF's), the Triton decode kernel vs its torch reference on
random bf16 data, and graph replay vs eager steps. ``--tiny`` runs a toy shape (CPU smoke test).
Prints a markdown table and writes ``bench_gpu.json`` (and the table) to ``--out``; ``--doc FILE`` writes the table
with the command, machine, versions and date into FILE's ``bench_gpu`` section (``--from-json`` re-renders it
from a saved ``bench_gpu.json`` without running).

The parts: inferflow's runs in bench_gpu_ours.py, HF's (and the interleaved decode phase) in bench_gpu_hf.py, the
kernel checks in bench_gpu_checks.py, the table and the docs section in bench_gpu_doc.py; this file runs the phases.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.bench.report import header  # noqa: E402
from inferflow.engine import Engine, EngineConfig  # noqa: E402

# the parts, re-exported here (tools/bench_overlap.py, tools/profile_gpu.py and tests import them from bench_gpu)
from bench_gpu_checks import kernel_check  # noqa: E402
from bench_gpu_doc import DOC_SECTION, table, write_doc  # noqa: E402
from bench_gpu_hf import HFStatic, decode_vs_hf, hf_prefill, hf_prefill_static  # noqa: E402,F401
from bench_gpu_ours import (T0, MemorySource, graph_gpu_ms, leading_same, load_shared, log,  # noqa: E402,F401
                            ours_decode, ours_prefill, ours_serving, sync)

QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--prefill-prompts", type=int, default=16)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later phases are skipped past it")
    ap.add_argument("--q4", action="store_true")
    ap.add_argument("--q4-format", default="q4_0", help="load-time format of --q4: q4_0 (llama.cpp Q4_0 blocks, "
                    "quick to make) or q4 (inferflow's searched q4: minutes for an 8B model)")
    ap.add_argument("--q4-ab", nargs="?", const="INFERFLOW_CUDA_KERNELS=0", metavar="ENV=VALUE",
                    help="with --q4: also a q4 engine captured with this variable set (default: "
                    "INFERFLOW_CUDA_KERNELS=0, Triton's kernels only), interleaved")
    ap.add_argument("--serving", type=int, default=256, help="requests of the engine serving load (0: skip)")
    ap.add_argument("--phases", default="prefill,graphs,serving,decode,q4",
                    help="the parts to run after the checks (q4 also needs --q4)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--doc", help="markdown file whose <!-- bench_gpu --> section gets the table (with the command, "
                                  "machine, versions and date)")
    ap.add_argument("--from-json", metavar="FILE", help="write --doc from an earlier run's bench_gpu.json, no run")
    args = ap.parse_args(argv)
    if args.from_json:
        if not args.doc:
            ap.error("--from-json writes --doc: give --doc too")
        write_doc(args.doc, json.loads(Path(args.from_json).read_text()))
        print(f"wrote the {DOC_SECTION} section of {args.doc} from {args.from_json}")
        return 0
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    batches = [int(b) for b in args.batches.split(",")]
    shape = TINY if args.tiny else QWEN3_8B
    res: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                           "torch": torch.__version__, "transformers": transformers.__version__,
                           "shape": shape, "args": vars(args), "date": time.strftime("%Y-%m-%d"),
                           "header": header(sys.argv[1:] if argv is None else argv, "python tools/bench_gpu.py")}
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (outdir / "bench_gpu.json").write_text(json.dumps(res, indent=1, default=str))

    def left() -> float:
        return args.budget - (time.perf_counter() - T0)

    torch._dynamo.config.cache_size_limit = max(32, torch._dynamo.config.cache_size_limit)
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**shape)
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        hf = transformers.Qwen3ForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
    log("HF model built")
    tmp = tempfile.mkdtemp(prefix="bench-gpu-")
    model = load_shared(hf, tmp, device)
    log("inferflow model loaded")
    V = shape["vocab_size"]
    g = torch.Generator().manual_seed(1)
    rand = lambda n, k: torch.randint(10, V, (n, k), generator=g).tolist()  # noqa: E731

    # correctness: logits of the last position
    cp = rand(4, 64)
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor(cp, device=device)).logits[:, -1].float()
    ours = torch.stack([model.logits(p)[-1] for p in cp])
    res["logits"] = {"max_rel_diff": ((ours - ref).abs().max() / ref.abs().max()).item(),
                     "top1_agree": int((ours.argmax(-1) == ref.argmax(-1)).sum()), "of": len(cp)}
    try:
        res["kernel_max_abs_err"] = kernel_check(device)
    except Exception as e:  # noqa: BLE001 - report; the engine falls back to torch attention by itself
        res["kernel_max_abs_err"] = f"{type(e).__name__}: {e}"[:3000]
    log(f"checks {res['logits']} kernel {res['kernel_max_abs_err']}")
    save()

    max_len = max(args.prompt_len + args.new_tokens, args.prefill_len, 768 if args.serving else 0) + 16
    ecfg = dict(max_num_seqs=max(batches), max_model_len=max_len, max_num_batched_tokens=16384,
                enable_prefix_caching=False, kv_cache_memory=4.0 if args.tiny else 24.0)
    eng = Engine(model, EngineConfig(**ecfg))
    def phase(name: str, fn: Any) -> None:
        """Run one part of the benchmark; a failure is recorded and the other parts still run."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            import traceback

            res[f"{name}_error"] = traceback.format_exc()[-3000:]
            log(f"{name} failed: {type(e).__name__}: {e}")
        save()

    def prefill() -> None:
        pp = rand(args.prefill_prompts, args.prefill_len)
        hp = pp[:4]
        hs = HFStatic(hf, False, args.prefill_len)  # the prompt's forward only: nothing compiled
        ours_prefill(eng, pp[:4], device)
        hf_prefill(hf, hp[:1], device)
        hf_prefill_static(hs, hp, device)
        ps: dict[str, list[float]] = {}
        for r in range(args.rounds):
            ps.setdefault("inferflow", []).append(ours_prefill(eng, pp, device))
            ps.setdefault("hf", []).append(hf_prefill(hf, hp, device))
            ps.setdefault("hf_static", []).append(hf_prefill_static(hs, hp, device))
            log(f"prefill round {r + 1}: {ps['inferflow'][-1]:.0f} vs HF eager {ps['hf'][-1]:.0f}, "
                f"HF static-cache path {ps['hf_static'][-1]:.0f} tok/s")
        hs.caches.clear()
        res["prefill"] = {k: {"tps": statistics.median(v), "samples": v} for k, v in ps.items()}

    phases = set(args.phases.split(","))
    if "prefill" in phases:
        phase("prefill", prefill)

    dprompts = {b: rand(b, args.prompt_len) for b in batches}
    for b in batches:  # warm-up: graphs captured, kernels compiled
        ours_decode(eng, dprompts[b], 4, device)
    log("inferflow warm-up done")

    def serving() -> None:  # through the engine (no HTTP): N requests, 512-token prompts, 256 new tokens
        res["serving"] = ours_serving(eng, rand(args.serving, 512), 256, device)
        log(f"serving {res['serving']}")

    if args.serving and "serving" in phases and left() > 200:
        phase("serving", serving)


    def q4() -> None:  # load-time 4-bit weights (the quantization helper's Triton kernels), interleaved with bf16
        qm = load_shared(hf, tmp, device, quant=args.q4_format)
        res["q4_format"] = args.q4_format
        res["q4_kernels"] = sorted({str(k) for m in qm.net.modules() for k in (getattr(m, "kernels", None) or {}).values()})
        log(f"q4 model loaded; kernels {res['q4_kernels']}")
        qcfg = EngineConfig(**{**ecfg, "kv_cache_memory": min(8.0, ecfg["kv_cache_memory"])})
        engines = []
        if args.q4_ab:  # a second q4 engine whose graphs captured its kernels with the variable set meanwhile
            var, _, value = args.q4_ab.partition("=")
            before = os.environ.get(var)
            os.environ[var] = value
            qt = Engine(qm, qcfg)
            for b in batches:
                ours_decode(qt, dprompts[b], 4, device)
            if before is None:
                os.environ.pop(var)
            else:
                os.environ[var] = before
            engines.append(("q4 triton" if args.q4_ab == "INFERFLOW_CUDA_KERNELS=0" else f"q4 {args.q4_ab}", qt))
        qe = Engine(qm, qcfg)
        qs: dict[str, list[float]] = {}
        for b in batches:
            ours_decode(qe, dprompts[b], 4, device)
        for r in range(max(1, args.rounds - 1)):
            for b in batches:
                for name, e in ((f"q4 b{b}", qe), (f"bf16 b{b}", eng), *((f"{n} b{b}", x) for n, x in engines)):
                    qs.setdefault(name, []).append(ours_decode(e, dprompts[b], args.new_tokens, device)[0])
                    log(f"q4 phase round {r + 1} {name}: {qs[name][-1]:.1f}")
        res["q4_decode"] = {k: {"tps": statistics.median(v), "samples": v} for k, v in qs.items()}


    def graphs_vs_eager() -> None:  # the same greedy tokens (batch 4, 32 tokens), and the speed of each
        eager = Engine(model, EngineConfig(**{**ecfg, "cuda_graphs": False}))
        p4 = dprompts[max(batches)][:4]
        ours_decode(eager, p4, 4, device)
        ta, a = ours_decode(eng, p4, 32, device)
        tc, c = ours_decode(eager, p4, 32, device)
        res["graphs_vs_eager_leading_same"] = [leading_same(x, y) for x, y in zip(a, c)]
        res["batch4_tps_graphs_vs_eager"] = [ta, tc]
        res["batch1_tps_graphs_vs_eager"] = [ours_decode(e, p4[:1], 32, device)[0] for e in (eng, eager)]
        log(f"graphs vs eager {res['graphs_vs_eager_leading_same']} b4 {res['batch4_tps_graphs_vs_eager']} "
            f"b1 {res['batch1_tps_graphs_vs_eager']}")

    if "graphs" in phases and left() > 170:
        phase("graphs_vs_eager", graphs_vs_eager)

    def decode() -> None:
        decode_vs_hf(args, res, eng, hf, dprompts, batches, device, left, log)

    if "decode" in phases:
        phase("decode", decode)
    if args.q4 and "q4" in phases and left() > 60:  # last: a slow quantization must not cost the other numbers
        phase("q4", q4)

    text = table(res, batches)
    print("\n" + text)
    (outdir / "bench_gpu.md").write_text(text + "\n")
    save()
    if args.doc:
        write_doc(args.doc, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
