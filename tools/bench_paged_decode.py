"""The paged decode kernel (inferflow/engine/triton_attention.py) on a GPU: max |diff| against the torch reference,
and GPU time per call, launches per call included, for launch variants (and a previous version of the module).

    python3 tools/bench_paged_decode.py [--old PATH] [--budget 40] [--out DIR]

Qwen3-8B attention shape (32 q heads, 8 KV heads, head 128, bf16, block size 16). Each case captures one CUDA graph of
``--layers`` calls, each on its own K/V cache and each after a 64 MB write that evicts L2 (as a layer's weight reads
do), and times the decode kernels of a few replays under torch.profiler (kernel time only, flushes excluded).

Variants of a case run one after another, and on an H200 the second place measured ~11% slower than the first on
the same kernel and config (170.8 against 189.3 us, docs/benchmarks.md). So each case runs ``--rounds`` rounds
(default 2), the order rotated by one place per round, and the JSON keeps every round's time and their median.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inferflow.engine import triton_attention as ta  # noqa: E402
from inferflow.engine.kv_store import quantize_int8  # noqa: E402

H, HKV, D, BS = 32, 8, 128, 16
FP8, INT8 = torch.float8_e4m3fn, torch.int8
VARIANTS: dict[str, dict[str, Any]] = {
    "new": {},
    "n32": {"block_n": 32},
    "n64": {"block_n": 64},
    "part64": {"min_part": 64},
    "part128": {"min_part": 128},
    "part32n32": {"min_part": 32, "block_n": 32},
    "part64n32": {"min_part": 64, "block_n": 32},
    "part128n32": {"min_part": 128, "block_n": 32},
    "n128": {"block_n": 128},
    "n128w8": {"block_n": 128, "num_warps": 8},
    "n256w8": {"block_n": 256, "num_warps": 8},
    "n64w8": {"block_n": 64, "num_warps": 8},
    "n128w8p512": {"block_n": 128, "num_warps": 8, "min_part": 512},
    "merge-kernel": {"ticket": False, "min_part": 64},
    "warps2": {"num_warps": 2},
    "st1": {"num_stages": 1},
}


def rotations(names: list[str], rounds: int) -> list[list[str]]:
    """The variants' order per round: each round starts one place further on, so every variant runs in every place
    as often as the rounds allow (a later place measured slower on the same kernel)."""
    return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)] if names else []


def load_old(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("old_triton_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_case(B: int, lens: list[int], max_len: int, layers: int, g: torch.Generator,
              dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    width = -(-max_len // BS)
    nb = B * width
    caches = [cache_pair(nb, g, dtype) for _ in range(layers)]
    tables = torch.randperm(nb, device="cuda", generator=g).view(B, width)
    q = torch.randn(B, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    return {"caches": caches, "tables": tables, "lens": torch.tensor(lens, device="cuda"), "q": q, "max_len": max_len}


def cache_pair(nb: int, g: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """K and V caches [nb, BS, HKV, D] of random values in ``dtype`` and the kernel's extra arguments (an int8
    cache's row scales, quantized as the engine does)."""
    x = [torch.randn(nb, BS, HKV, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in "kv"]
    if dtype != INT8:
        return x[0].to(dtype), x[1].to(dtype), {}
    (kc, ks), (vc, vs) = (quantize_int8(t.view(-1, HKV, D)) for t in x)
    return kc.view(x[0].shape), vc.view(x[0].shape), {"k_scales": ks, "v_scales": vs}


def time_variant(fn: Any, case: dict[str, Any], reps: int = 5) -> tuple[float, float, float]:
    """(max |diff| of layer 0 after the replays, us of decode kernels per call, launches per call)."""
    from torch.profiler import ProfilerActivity, profile

    scratch = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    q, tables, lens, ml = case["q"], case["tables"], case["lens"], case["max_len"]

    def step() -> torch.Tensor:
        outs = []
        for kc, vc, kw in case["caches"]:
            scratch.fill_(1)
            outs.append(fn(q, kc, vc, tables, lens, scale=D ** -0.5, max_len=ml, **kw))
        return outs[0]

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
        step()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        out = step()
    for _ in range(3):
        gr.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            gr.replay()
        torch.cuda.synchronize()
    us, n = 0.0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("_decode"):
            us += e.device_time_total
            n += 1
    calls = reps * len(case["caches"])
    kc, vc, kw = case["caches"][0]
    ref = ta.paged_decode_reference(q, kc, vc, tables, lens, scale=D ** -0.5, **kw)
    return (out.float() - ref.float()).abs().max().item(), us / calls, n / calls


def features() -> dict[str, float]:
    """Soft-cap, window, fp16, fp8 and int8 caches, ragged lengths, both merge paths: max |diff| against the
    reference."""
    g = torch.Generator(device="cuda").manual_seed(5)
    out = {}
    for dt, cdt in ((torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.bfloat16, FP8),
                    (torch.bfloat16, INT8)):
        kc, vc, sc = cache_pair(1200, g, cdt)
        for B in (1, 3, 64):
            q = torch.randn(B, H, D, device="cuda", generator=g).to(dt)
            lens = torch.randint(1, 2048, (B,), device="cuda", generator=g)
            lens[0] = 2048
            tables = torch.stack([torch.randperm(1200, device="cuda", generator=g)[:128] for _ in range(B)])
            for name, kw in {"plain": {}, "softcap": {"softcap": 30.0}, "window": {"window": 100},
                             "merge-kernel": {"ticket": False}, "part32": {"min_part": 32, "block_n": 32}}.items():
                o = ta.paged_decode(q, kc, vc, tables, lens, scale=D ** -0.5, max_len=2048, **kw, **sc)
                kw = {k: v for k, v in kw.items() if k in ("softcap", "window")}
                r = ta.paged_decode_reference(q, kc, vc, tables, lens, scale=D ** -0.5, **kw, **sc)
                tag = {FP8: "fp8 cache ", INT8: "int8 cache "}.get(cdt, "")
                out[f"{dt} {tag}B{B} {name}"] = (o.float() - r.float()).abs().max().item()
    return out


def fused_kv_check() -> dict[str, float]:
    """The q/k norm + RoPE kernel storing K/V into the cache (fused_qk_rope.py) against the separate torch ops."""
    from types import SimpleNamespace

    from inferflow.engine.kv_cache import KVLayer, PagedKVCache
    from inferflow.model import fused_qk_rope
    from inferflow.model.context import ForwardContext
    from inferflow.registry import create

    g = torch.Generator(device="cuda").manual_seed(7)
    N = 64
    qkv = torch.randn(N, (H + 2 * HKV) * D, device="cuda", generator=g).to(torch.bfloat16) * 3
    q, k, v = qkv.split([H * D, HKV * D, HKV * D], -1)
    norms = [create("rmsnorm", {"dim": D, "eps": 1e-6}) for _ in range(2)]
    for nm in norms:
        nm.weight = torch.nn.Parameter(torch.randn(D, device="cuda", generator=g).to(torch.bfloat16),
                                       requires_grad=False)
    rope = create("rope", {"dim": D, "theta": 1e6})
    cache = PagedKVCache([KVLayer(0, HKV, D)], 64, BS, dtype="bfloat16", device="cuda", compute_dtype=torch.bfloat16)
    slots = torch.randperm(64 * BS, device="cuda", generator=g)[:N]
    ctx = ForwardContext(positions=torch.arange(N, device="cuda") * 37, q_lens=[1] * N, k_lens=[1] * N,
                         backend=SimpleNamespace(cache=cache, slots=slots))
    ctx.position = rope
    attn = SimpleNamespace(use_position=True, q_norm=norms[0], k_norm=norms[1], d=D, h=H, hkv=HKV,
                           qk_norm_per_head=True, cache_key=0)
    got = fused_qk_rope.norm_rope(attn, q, k, ctx, v)
    cos, sin = rope.cos_sin(ctx, torch.bfloat16)
    rq = rope._rot(norms[0](q.reshape(N, H, D)), cos, sin)
    rk = rope._rot(norms[1](k.reshape(N, HKV, D)), cos, sin)
    claimed = "_claimed" in cache.__dict__
    kf, vf = cache._dev[0].k.view(-1, HKV, D), cache._dev[0].v.view(-1, HKV, D)
    return {"claimed": float(claimed), "q": (got[0].float() - rq.float()).abs().max().item(),
            "k": (got[1].float() - rk.float()).abs().max().item(),
            "k_cache": (kf[slots].float() - rk.float()).abs().max().item(),
            "v_cache": (vf[slots].float() - v.reshape(N, HKV, D).float()).abs().max().item()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="")
    ap.add_argument("--budget", type=float, default=40.0)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--cases", default="", help="comma-separated case names to run (default: all)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per case, the variants' order rotated each round; "
                    "the JSON's us is the median over rounds")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    t0 = time.time()
    res: dict[str, Any] = {"features": features()}
    print("features", json.dumps(res["features"]), flush=True)
    try:
        res["fused_kv"] = fused_kv_check()
    except Exception as e:  # noqa: BLE001
        res["fused_kv"] = f"{type(e).__name__}: {e}"
    print("fused q/k norm + rope + kv write", res["fused_kv"], flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = {"b1 L136": (1, [136], 288), "b64 L136": (64, [136] * 64, 288), "b1 L4000": (1, [4000], 4112),
             "b64 ragged<=1000": (64, torch.randint(1, 1000, (64,)).tolist(), 1040), "b8 L136": (8, [136] * 8, 288),
             "b1 L1024": (1, [1024], 1040), "b16 L512": (16, [512] * 16, 528),
             "b256 L640": (256, [640] * 256, 656), "b256 L640 fp8": (256, [640] * 256, 656, FP8),
             "b64 ragged<=1000 fp8": (64, torch.randint(1, 1000, (64,)).tolist(), 1040, FP8),
             "b256 L640 int8": (256, [640] * 256, 656, INT8), "b1 L4000 int8": (1, [4000], 4112, INT8)}
    fns = {}
    if a.old:
        fns["old"] = load_old(a.old).paged_decode
    for v in a.variants.split(","):
        kw = VARIANTS[v]
        fns[v] = (lambda kw: lambda *x, **k: ta.paged_decode(*x, **k, **kw))(kw)
    if a.cases:
        cases = {k: v for k, v in cases.items() if k in a.cases.split(",")}
    for cname, (B, lens, ml, *dt) in cases.items():
        case = make_case(B, lens, ml, a.layers if B < 64 else a.layers // (3 if B < 256 else 9), g, *dt)
        for r, order in enumerate(rotations(list(fns), a.rounds)):
            if time.time() - t0 > a.budget:
                print("budget spent", flush=True)
                break
            for pos, name in enumerate(order):
                try:
                    err, us, n = time_variant(fns[name], case)
                    row = res.setdefault(f"{cname} | {name}", {"err": 0.0, "us_by_round": [], "launches": n})
                    row["err"] = max(row["err"], err)
                    row["us_by_round"].append(us)
                    row["us"] = statistics.median(row["us_by_round"])
                    print(f"{cname:18s} | {name:16s} | {us:7.2f} us | round {r + 1}, place {pos + 1} | {n:.0f} "
                          f"launches | err {err:.2e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"{cname} | {name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        for name in fns:
            row = res.get(f"{cname} | {name}")
            if row is not None and len(row["us_by_round"]) > 1:
                print(f"{cname:18s} | {name:16s} | {row['us']:7.2f} us median of {len(row['us_by_round'])} rounds",
                      flush=True)
        del case
        torch.cuda.empty_cache()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "bench_paged_decode.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
