"""Quantized linears on CPU: kernel candidates per GGUF block type at decode shapes, and the default model's decode.

    python tools/bench_quant_linear.py [--threads 1] [--rounds 5] [--quick] [--no-e2e] [--tokens 32]

1. Per type and shape (N x K, batch rows M), every candidate is timed in the same run, interleaved round by round
   (a shared, throttling VM drifts between runs), and the medians are printed with speed-ups over "reference"
   (the bit-exact ggml dequantization each call, inferflow.quant.packed.packed_linear). "fast" is what
   inferflow.quant.cpu_kernels runs by default (for Q5_0, Q5_1 and the k-quants but Q4_K: the reference path
   itself). The rest are candidates it did not pick, kept for the record: chunked-decode (the ggml decoder in
   cache-sized row chunks into a preallocated output, as the Q8_0 path does), int4-dequant (the int4 packing
   dequantized to bf16 chunk by chunk for bf16 GEMMs: the large-batch path), q8-as-2xint4 (Q8_0 codes split in
   two int4 kernel calls: bf16, 10 bits per weight) and int8pack-rowwise (Q8_0 requantized per output row for
   _weight_int8pack_mm, bf16: not the file's weights). "err": max|y - y_exact| / max|y_exact| at M = 1.
2. The int4 kernel's per-row cost against one dequantization of the weight: where INT4_MAX_ROWS comes from.
3. The embedded default model (SmolLM2-135M-Instruct, Q4_1 + Q8_0): Model.generate_ids of --tokens greedy tokens
   under both kernel sets, interleaved; ms/token = (time(tokens) - time(1 token)) / (tokens - 1).
4. (first) inferflow's own formats (--formats; --only-formats runs just this): one default-model layer of linears
   at M = 1, fast vs reference vs float32 F.linear, with the implied decode tok/s (30 layers, linears only).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import gguf
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # random GGUF blocks

from inferflow.quant import PackedTensor, cpu_kernels, ggml, int4pack  # noqa: E402
from inferflow.quant.packed import hold, packed_linear  # noqa: E402
from gguf_files import random_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
LAYER_SHAPES = [(576, 576), (1536, 576), (576, 1536)]  # (N, K): attention, gate/up, down of the default model
VOCAB = (49152, 576)                                    # its tied head / token embedding
K_SHAPES = [(576, 768), (1536, 768), (576, 1536)]       # k-quants need K % 256 == 0: 576 -> 768


def median_times(fns: dict, rounds: int) -> dict[str, float]:
    """Median ms per call; each sample averages enough calls to last ~5 ms; candidates interleaved per round."""
    inner = {}
    for name, fn in fns.items():
        fn()
        t = time.perf_counter()
        fn()
        inner[name] = max(1, int(0.005 / max(time.perf_counter() - t, 1e-6)))
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = time.perf_counter()
            for _ in range(inner[name]):
                fn()
            samples[name].append((time.perf_counter() - t) / inner[name] * 1e3)
    return {name: statistics.median(v) for name, v in samples.items()}


def candidates(qtype: Q, rows: int, cols: int) -> tuple[dict, torch.Tensor, torch.nn.Module]:
    """name -> fn(x); the exact dequantized weight; the module holding the weight as "fast" does."""
    blocks = random_blocks(qtype, rows, cols)
    t = PackedTensor(blocks, int(qtype), (rows, cols))
    ref_mod, fast_mod = torch.nn.Module(), torch.nn.Module()
    for mod in (ref_mod, fast_mod):
        mod.register_parameter("weight", None)
    hold(ref_mod, "weight", t)
    with cpu_kernels.using("fast"):
        cpu_kernels.hold_linear(fast_mod, "weight", t)
    out = {"reference": lambda x: packed_linear(ref_mod, "weight", x, None),
           "fast": lambda x: cpu_kernels.linear(fast_mod, "weight", x, None)}
    if fast_mod.kernels["weight"] == "int4":
        p, sz = fast_mod.weight_int4, fast_mod.weight_int4_sz
        k = len(int4pack.parts_of(int(qtype)))  # Q8_0: two planes side by side along K, x repeated
        out["int4-dequant"] = lambda x: int4pack.matmul_dequantized(x.repeat(1, k), p, sz, (rows, k * cols),
                                                                    cpu_kernels.CHUNK_ELEMS)
    if qtype == Q.Q8_0:
        out.update(_q8_alternatives(blocks, rows, cols))
    if fast_mod.kernels["weight"] == "reference":  # the candidate measured and rejected for these types
        out["chunked-decode"] = lambda x: cpu_kernels._chunked(
            x, (rows, cols), lambda r, n: ggml.dequantize(blocks[r:r + n], int(qtype), (n, cols), x.dtype))
    return out, ggml.dequantize(blocks, int(qtype), (rows, cols)), fast_mod


def _q8_alternatives(blocks: torch.Tensor, rows: int, cols: int) -> dict:
    b = blocks.view(rows, cols // 32, 34)
    q = b[:, :, 2:].contiguous().view(torch.int8).to(torch.int32) + 128      # 16 h + l, both 0..15
    d = b[:, :, :2].contiguous().view(torch.float16).float().squeeze(-1)     # [N, G]
    # d q = 16 d (h - 8) + d (l - 8) + 8 d: two int4 kernel calls over the same activations
    hi = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q >> 4).view(rows, cols).contiguous(), 1)
    lo = torch.ops.aten._convert_weight_to_int4pack_for_cpu((q & 15).view(rows, cols).contiguous(), 1)
    sz_hi = torch.stack([16 * d, torch.zeros_like(d)], -1).transpose(0, 1).bfloat16().contiguous()
    sz_lo = torch.stack([d, 8 * d], -1).transpose(0, 1).bfloat16().contiguous()
    w = ggml.dequantize(blocks, ggml.Q8_0, (rows, cols))
    s = w.abs().amax(1) / 127                                               # per-row requantization
    w8 = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
    return {"q8-as-2xint4": lambda x: (int4pack.matmul(x, hi, sz_hi).float() + int4pack.matmul(x, lo, sz_lo)),
            "int8pack-rowwise": lambda x: torch.ops.aten._weight_int8pack_mm(x.bfloat16(), w8, s.bfloat16()).float()}


def kernel_table(types, shapes, ms, rounds) -> None:
    print(f"\n## 1. candidates per type and shape (median ms per call, {rounds} interleaved rounds)")
    for qtype in types:
        for rows, cols in shapes:
            fns, w, _ = candidates(qtype, rows, cols)
            x1 = torch.randn(1, cols)
            exact = F.linear(x1, w)
            errs = {n: ((f(x1).float() - exact).abs().max() / exact.abs().max()).item() for n, f in fns.items()}
            print(f"\n{qtype.name} N={rows} K={cols}  err: " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()))
            for m in ms:
                x = torch.randn(m, cols)
                t = median_times({n: (lambda f=f: f(x)) for n, f in fns.items()}, rounds)
                cells = "  ".join(f"{n} {v:8.3f}" for n, v in t.items())
                ratios = "  ".join(f"{n} x{t['reference'] / v:5.1f}" for n, v in t.items() if n != "reference")
                print(f"  M={m:3d}  {cells}   | speed-up vs reference: {ratios}")


def threshold_table(rounds) -> None:
    print("\n## 2. int4 kernel vs dequantizing its weight once (Q4_1), by batch rows M (median ms)")
    for rows, cols in LAYER_SHAPES:
        fns, _, mod = candidates(Q.Q4_1, rows, cols)
        kernel = lambda x: int4pack.matmul(x, mod.weight_int4, mod.weight_int4_sz)  # noqa: E731
        for m in (32, 64, 96, 128, 256, 512):
            x = torch.randn(m, cols)
            t = median_times({"kernel": lambda: kernel(x), "int4-dequant": lambda: fns["int4-dequant"](x)}, rounds)
            print(f"  N={rows:5d} K={cols:5d} M={m:4d}  kernel {t['kernel']:8.3f}  "
                  f"int4-dequant {t['int4-dequant']:8.3f}"
                  f"  kernel/dequant {t['kernel'] / t['int4-dequant']:5.2f}")


def end_to_end(tokens: int, rounds: int) -> None:
    import inferflow
    from inferflow.default_model import default_model_path

    path = default_model_path()
    print(f"\n## 3. default model {path.name}: generate_ids, {tokens} greedy tokens, {rounds} interleaved rounds")
    models, loads = {}, {}
    for kind in ("reference", "fast"):
        t = time.perf_counter()
        models[kind] = inferflow.load(path, quant_kernels=kind)
        loads[kind] = time.perf_counter() - t
    tok = models["fast"].tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    for m in models.values():
        m.generate_ids(ids, max_new_tokens=2, stop_ids=set())
    per_tok, prefill, outs = {k: [] for k in models}, {k: [] for k in models}, {}
    for _ in range(rounds):
        for kind, m in models.items():
            t0 = time.perf_counter()
            m.generate_ids(ids, max_new_tokens=1, stop_ids=set())
            t1 = time.perf_counter()
            outs[kind] = m.generate_ids(ids, max_new_tokens=tokens, stop_ids=set())
            t2 = time.perf_counter()
            prefill[kind].append((t1 - t0) * 1e3)
            per_tok[kind].append(((t2 - t1) - (t1 - t0)) / (tokens - 1) * 1e3)
    med = {k: statistics.median(v) for k, v in per_tok.items()}
    for kind in models:
        print(f"  {kind:9s} load {loads[kind]:5.2f} s  prompt ({len(ids)} ids) + 1 token "
              f"{statistics.median(prefill[kind]):7.1f} ms  decode {med[kind]:7.2f} ms/token "
              f"({1e3 / med[kind]:6.1f} tok/s)")
    same = sum(a == b for a, b in zip(outs["fast"], outs["reference"]))
    print(f"  speed-up fast vs reference: x{med['reference'] / med['fast']:.1f}; "
          f"greedy tokens identical: "
          f"{same}/{tokens}; fast says: {tok.decode(outs['fast'])!r}")


# One decoder layer of the default model: q, k, v, o, gate, up, down as (N, K); 30 such layers per token
DEFAULT_LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]


def format_table(names: list[str], rounds: int, layers: int = 30) -> None:
    """inferflow's own formats, one decode step (M = 1) through a default-model layer of linears: fast (the kernel
    each format runs by default) against reference (bit-exact decode every call) and float32 F.linear."""
    from inferflow.quant import formats
    from inferflow.registry import create

    print(f"\n## 4. inferflow formats: one default-model layer of linears at M=1 (median ms, {rounds} interleaved "
          f"rounds); tok/s = 1 / ({layers} layers x layer time), linears only")
    fns, errs, kinds = {}, {}, {}
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) * 0.02 for n, k in DEFAULT_LAYER]
    xs = {k: torch.randn(1, k, generator=g) for k in {k for _, k in DEFAULT_LAYER}}
    fns["float32"] = lambda: [F.linear(xs[w.shape[1]], w) for w in ws]
    for name in names:
        for kernels in ("fast", "reference"):
            mods = []
            for w in ws:
                lin = create("linear", {"in_features": w.shape[1], "out_features": w.shape[0], "bias": False})
                with cpu_kernels.using(kernels):
                    lin.load_packed("weight", formats.quantize(w, name), torch.float32)
                mods.append(lin)
            fns[f"{name}/{kernels}"] = lambda mods=mods: [m(xs[m.in_features]) for m in mods]
            if kernels == "fast":
                kinds[name] = sorted({m.kernels["weight"] for m in mods})
                exact = [F.linear(xs[w.shape[1]], formats.quantize(w, name).dequantize()) for w in ws]
                errs[name] = max(((m(xs[w.shape[1]]) - e).abs().max() / e.abs().max()).item()
                                 for m, w, e in zip(mods, ws, exact))
    t = median_times(fns, rounds)
    print(f"  {'format':8s} {'kernel':8s} {'fast ms':>8s} {'ref ms':>8s} {'fast/ref':>8s} {'fast tok/s':>10s} "
          f"{'ref tok/s':>9s} {'err':>8s}")
    print(f"  {'float32':8s} {'F.linear':8s} {t['float32']:8.3f} {'':8s} {'':8s} {1e3 / (layers * t['float32']):10.1f}")
    for name in names:
        f, r = t[f"{name}/fast"], t[f"{name}/reference"]
        print(f"  {name:8s} {','.join(kinds[name]):8s} {f:8.3f} {r:8.3f} {r / f:7.1f}x {1e3 / (layers * f):10.1f} "
              f"{1e3 / (layers * r):9.1f} {errs[name]:8.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--e2e-rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="default model's types and shapes only (Q4_1, Q8_0 head)")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--formats", default="q8,q6,q5,q4,q3.5,q3,q2",
                    help="inferflow formats for section 4 ('' to skip)")
    ap.add_argument("--only-formats", action="store_true", help="section 4 only")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {a.threads} thread(s); "
          f"INT4_MAX_ROWS={cpu_kernels.INT4_MAX_ROWS}, CHUNK_ELEMS={cpu_kernels.CHUNK_ELEMS}")
    ms = (1, 4, 16, 32)
    if a.formats:
        format_table([f for f in a.formats.split(",") if f], a.rounds)
    if a.only_formats:
        return
    if a.quick:
        kernel_table([Q.Q4_1], LAYER_SHAPES, ms, a.rounds)
        kernel_table([Q.Q8_0], [VOCAB], ms, a.rounds)
    else:
        kernel_table([Q.Q4_0, Q.Q4_1, Q.Q8_0], LAYER_SHAPES + [VOCAB], ms, a.rounds)
        kernel_table([Q.Q4_K], K_SHAPES + [(VOCAB[0], 768)], ms, a.rounds)
        kernel_table([Q.Q5_0, Q.Q5_1], LAYER_SHAPES, ms, a.rounds)
        kernel_table([Q.Q2_K, Q.Q3_K, Q.Q5_K, Q.Q6_K], K_SHAPES, ms, a.rounds)
        threshold_table(a.rounds)
    if not a.no_e2e:
        end_to_end(a.tokens, a.e2e_rounds)


if __name__ == "__main__":
    main()
