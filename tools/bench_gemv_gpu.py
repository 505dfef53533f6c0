"""The Triton GEMV for 16-bit weights (inferflow/model/gpu_gemv.py) against cuBLAS on a GPU, at decode shapes.

    python tools/bench_gemv_gpu.py [--rows 1,2,4,64] [--reps 9] [--stack 36] [--e2e] [--out DIR]

1. Sweep: Qwen3-8B-shaped projections (qkv fused 6144x4096, o 4096x4096, gate_up fused 24576x4096, down
   4096x12288, head 151936x4096), bf16: cuBLAS (F.linear) and every Triton config timed as the selector does
   (gpu_gemv.time_cuda: in CUDA graphs, weights never in L2), medians in us and TB/s of weight + activation bytes;
   each config's max |diff| against float32; which one the selector (gpu_gemv.select) picks. Rows > 4: cuBLAS.
2. Stack: ``--stack`` layers of the four projections (own weights, as in a decode step) as one CUDA graph of M=1
   calls, all cuBLAS vs the selector's choices, replays interleaved: the GEMM time of a batch-1 decode step.
3. ``--e2e``: inferflow's Engine on a random Qwen3-8B-shaped model, batch-1 greedy decode (128-token prompt),
   cuBLAS vs gpu_gemv (two engines over the same weights, each graph captured with its own choices), rounds
   interleaved.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.model import gpu_gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "head": (151936, 4096)}
T0 = time.perf_counter()
DEV = "cuda"  # a CPU smoke test sets "cpu" (with TRITON_INTERPRET=1 and a fake timer)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def cfg_name(c: gpu_gemv.Config | None) -> str:
    if c is None:
        return "cublas"
    return f"n{c.block_n}k{c.block_k}w{c.warps}" + (f"s{c.split_k}" if c.split_k > 1 else "") + \
        ("e" if c.sum_each else "") + (f"p{c.stages}" if c.stages > 1 else "")


def sweep(rows: list[int], reps: int, dtype: torch.dtype) -> list[dict]:
    out = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device=DEV).to(dtype)
        for m in rows:
            x = torch.randn(m, k, device=DEV).to(dtype)
            ref = F.linear(x.float(), w.float())
            cfgs = gpu_gemv.configs(m) if m <= gpu_gemv.MAX_ROWS else []
            errs = [((gpu_gemv.gemv(x, w, None, c).float() - ref).abs().max() / ref.abs().max()).item() for c in cfgs]
            ts = gpu_gemv.time_cuda([lambda w_: F.linear(x, w_)]
                                    + [lambda w_, c=c: gpu_gemv.gemv(x, w_, None, c) for c in cfgs], w, reps)
            byts = (n * k + m * k + m * n) * w.element_size()
            pick = gpu_gemv.select(x, w, None)[0] if m <= gpu_gemv.MAX_ROWS else None
            row = {"shape": name, "N": n, "K": k, "M": m, "cublas_us": ts[0], "cublas_TBs": byts / ts[0] / 1e6,
                   "cublas_rel_err": ((F.linear(x, w).float() - ref).abs().max() / ref.abs().max()).item(),
                   "configs": {cfg_name(c): {"us": t, "TBs": byts / t / 1e6, "rel_err": e}
                               for c, t, e in zip(cfgs, ts[1:], errs)},
                   "pick": cfg_name(pick), "linear_declines": gpu_gemv.linear(x, w) is None}
            best = min(row["configs"].items(), key=lambda kv: kv[1]["us"], default=None)
            log(f"{name:8s} M={m:3d} cuBLAS {ts[0]:7.1f} us {row['cublas_TBs']:.2f} TB/s | best triton "
                + (f"{best[0]} {best[1]['us']:7.1f} us {best[1]['TBs']:.2f} TB/s (x{ts[0] / best[1]['us']:.2f})"
                   if best else "-") + f" | pick {row['pick']} | max rel err {max(errs, default=0):.1e} "
                f"(cuBLAS {row['cublas_rel_err']:.1e})")
            log("   " + " ".join(f"{k_}:{v['us']:.1f}" for k_, v in row["configs"].items()))
            out.append(row)
        del w
    return out


def stack(layers: int, reps: int, dtype: torch.dtype) -> dict:
    """One CUDA graph of a decode step's projections at M=1, cuBLAS only vs the selector's choices."""
    shapes = [SHAPES[s] for s in ("qkv", "o", "gate_up", "down")]
    ws = [[torch.randn(n, k, device=DEV).to(dtype) for n, k in shapes] for _ in range(layers)]
    xs = {k: torch.randn(1, k, device=DEV).to(dtype) for k in (4096, 12288)}

    def step(use: bool) -> None:
        gpu_gemv.ENABLED = use
        for lw in ws:
            for w in lw:
                x = xs[w.shape[1]]
                y = gpu_gemv.linear(x, w) if use else None
                if y is None:
                    F.linear(x, w)

    graphs = {}
    for use in (False, True):
        with gpu_gemv.selecting():
            step(use)  # the selector times each shape here, outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(use)
        graphs["triton" if use else "cublas"] = g
    gpu_gemv.ENABLED = True
    ms: dict[str, list[float]] = {k: [] for k in graphs}
    for _ in range(reps):
        for k, g in graphs.items():
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(5):
                g.replay()
            e.record()
            torch.cuda.synchronize()
            ms[k].append(s.elapsed_time(e) / 5)
    med = {k: statistics.median(v) for k, v in ms.items()}
    byts = layers * sum(n * k for n, k in shapes) * 2
    res = {"layers": layers, "ms": med, "TBs": {k: byts / v / 1e9 for k, v in med.items()},
           "ratio_cublas_over_triton": med["cublas"] / med["triton"],
           "choices": {f"{m}x{n}x{k}": cfg_name(c) for (m, n, k, *_), c in gpu_gemv._choice.items()}}
    log(f"stack of {layers} layers, M=1: {json.dumps(res)}")
    ws.clear()  # the weights (~16 GB) go before the end-to-end run
    return res


def e2e(rounds: int, new_tokens: int) -> dict:
    """Batch-1 decode through the Engine, gpu_gemv off vs on (the graphs captured each way), interleaved."""
    import tempfile

    import transformers
    from bench_gpu_ours import graph_gpu_ms, load_shared  # tools/: the script's folder

    from inferflow.engine import Engine, EngineConfig, SamplingParams

    shape = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape)).eval()
        torch.set_default_dtype(torch.float32)
    model = load_shared(hf, tempfile.mkdtemp(prefix="gemv-e2e-"), DEV)
    log("model loaded")
    prompt = torch.randint(0, shape["vocab_size"], (128,), generator=torch.Generator().manual_seed(1)).tolist()
    ecfg = dict(max_num_seqs=1, max_model_len=512, max_num_batched_tokens=2048, enable_prefix_caching=False,
                kv_cache_memory=2.0)

    def decode(eng: Engine, n: int) -> tuple[float, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        h = eng.add_request(prompt, params)
        t_first = g_first = None
        g0 = eng.counters.generation_tokens
        while eng.has_unfinished():
            eng.step()
            if t_first is None and eng.counters.generation_tokens - g0 >= 1:
                torch.cuda.synchronize()
                t_first, g_first = time.perf_counter(), eng.counters.generation_tokens
        torch.cuda.synchronize()
        return (eng.counters.generation_tokens - g_first) / (time.perf_counter() - t_first), \
            h.result().outputs[0].token_ids

    engines = {}
    allc = gpu_gemv.CONFIGS
    variants = {"cublas": None, "triton": allc}
    for name, cfgs in variants.items():  # each engine's graph captured with its own choices (selector on / off)
        gpu_gemv.ENABLED = cfgs is not None
        gpu_gemv.CONFIGS = cfgs or allc
        gpu_gemv._choice.clear()
        engines[name] = eng = Engine(model, EngineConfig(**ecfg))
        decode(eng, 4)  # warm-up: the selector times here (on), then the bucket-1 graph is captured
        log(f"{name} warm; choices {sorted({cfg_name(c) for c in gpu_gemv._choice.values()})}")
    gpu_gemv.ENABLED, gpu_gemv.CONFIGS = True, allc
    tps: dict[str, list[float]] = {k: [] for k in engines}
    toks = {}
    for r in range(rounds):
        for k, eng in engines.items():
            t, toks[k] = decode(eng, new_tokens)
            tps[k].append(t)
        log(f"round {r + 1}: " + " ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in tps.items()))
    replay = {k: ms for k, eng in engines.items() for ms in graph_gpu_ms(eng, [1]).values()}
    same = next((i for i, (a, b) in enumerate(zip(toks["cublas"], toks["triton"])) if a != b), len(toks["triton"]))
    res = {"tok_s": {k: statistics.median(v) for k, v in tps.items()}, "samples": tps, "replay_ms": replay,
           "leading_tokens_same": same, "of": len(toks["triton"])}
    res["ratio_over_cublas"] = {k: v / res["tok_s"]["cublas"] for k, v in res["tok_s"].items()}
    log(f"e2e: {json.dumps(res)}")
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,64")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--stack", type=int, default=36, help="layers of the graph A/B (0: skip)")
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    dtype = getattr(torch, args.dtype)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    import triton

    res["triton"] = triton.__version__
    log(f"{res['device']} torch {torch.__version__} triton {triton.__version__}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (out / "bench_gemv_gpu.json").write_text(json.dumps(res, indent=1, default=str))

    with torch.inference_mode():
        res["sweep"] = sweep([int(r) for r in args.rows.split(",")], args.reps, dtype)
        save()
        if args.stack:
            res["stack"] = stack(args.stack, 10, dtype)
            save()
        torch.cuda.empty_cache()
    if args.e2e:
        res["e2e"] = e2e(args.rounds, args.new_tokens)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
