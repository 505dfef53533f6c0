"""Where a GPU decode step's time goes: kernel tables of one graph replay per batch bucket, and the GEMMs alone.

    python3 tools/profile_gpu.py [--out DIR] [--batches 1,64] [--q4] [--tiny]

Builds the same Qwen3-8B-shaped bf16 model as ``tools/bench_gpu.py``, runs the engine until every bucket's CUDA
graph is captured, then records ``--replays`` replays of each bucket under torch.profiler and prints the kernels
by total GPU time (per replay), their count per replay and the sum. A few full engine steps at the largest batch are
traced too (``engine_b{B}.json``, Chrome/Perfetto format), which shows the host work between replays. The
standalone table times each projection's GEMM (cuBLAS, bf16) at every batch size against its weight-read time
at the measured copy bandwidth. ``--q4`` adds the same kernel table for the load-time Q4_0 model. ``--prefill N`` profiles prefill instead of decode:
the engine's steps for 4 prompts of N tokens (one 8192-token step at N = 2048) and HF's eager forward of the same
prompts (``logits_to_keep=1``, as ``tools/bench_gpu.py`` times it), kernel by kernel, and cuBLAS alone on each
projection at that many tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_gpu import QWEN3_8B, TINY, load_shared, log, ours_decode  # noqa: E402

from inferflow.engine import Engine, EngineConfig  # noqa: E402


def kernel_table(fn: Any, reps: int) -> list[tuple[str, float, float]]:
    """(kernel name, GPU ms per rep, launches per rep) of ``fn`` run ``reps`` times under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    tot: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t = tot[e.name[:110]]
            t[0] += e.device_time_total / 1e3
            t[1] += 1
    return sorted(((k, v[0] / reps, v[1] / reps) for k, v in tot.items()), key=lambda r: -r[1])


def print_table(title: str, rows: list[tuple[str, float, float]], top: int = 30) -> dict[str, Any]:
    total = sum(r[1] for r in rows)
    print(f"\n### {title}: {total:.3f} GPU ms per replay, {sum(r[2] for r in rows):.0f} kernels")
    print("| kernel | ms/replay | launches | share |\n|---|---:|---:|---:|")
    for k, ms, n in rows[:top]:
        print(f"| `{k}` | {ms:.4f} | {n:.0f} | {100 * ms / max(total, 1e-9):.1f}% |")
    return {"total_ms": total, "rows": rows}


def replay_fn(eng: Engine, b: int) -> Any:
    graphs = eng.runner.graphs
    hit = graphs._graphs.get(graphs.bucket(b)) if graphs is not None else None
    return None if hit is None else hit[0].replay


def gemm_table(shape: dict, batches: list[int]) -> dict[str, Any]:
    h, i = shape["hidden_size"], shape["intermediate_size"]
    d, nq, nkv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
    shapes = {"qkv": (h, (nq + 2 * nkv) * d), "o": (nq * d, h), "gate_up": (h, 2 * i), "down": (i, h),
              "head": (h, shape["vocab_size"])}
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    dst.copy_(src)
    ev[0].record()
    for _ in range(10):
        dst.copy_(src)
    ev[1].record()
    torch.cuda.synchronize()
    bw = 2 * 10 * src.numel() / (ev[0].elapsed_time(ev[1]) / 1e3)  # read + write bytes per second
    del src, dst
    out: dict[str, Any] = {"copy_bw_GBs": bw / 1e9}
    print(f"\n### GEMMs alone (bf16, cuBLAS); copy bandwidth {bw / 1e9:.0f} GB/s\n"
          "| proj | K x N | M | ms | weight-read ms at copy bw | ratio |\n|---|---|---:|---:|---:|---:|")
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            torch.nn.functional.linear(x, w)
            ev[0].record()
            for _ in range(50):
                torch.nn.functional.linear(x, w)
            ev[1].record()
            torch.cuda.synchronize()
            ms = ev[0].elapsed_time(ev[1]) / 50
            lim = w.numel() * 2 / bw * 1e3
            out[f"{name} M{m}"] = ms
            print(f"| {name} | {k} x {n} | {m} | {ms:.4f} | {lim:.4f} | {ms / lim:.2f} |")
    return out


def idle_gaps(fn: Any, top: int = 12, what: str = "one engine prefill", min_us: float = 50) -> dict[str, Any]:
    """Where the GPU waits on the host in one run of ``fn``: wall time, GPU busy time, and the longest gaps between
    kernels (over ``min_us``) with the host ops running at the time (torch.profiler, CPU and CUDA)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    ev = prof.events()
    gpu = sorted((e.time_range.start, e.time_range.end) for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
    cpu = [e for e in ev if e.device_type == torch.autograd.DeviceType.CPU]
    busy = sum(b - a for a, b in gpu) / 1e3
    gaps = []
    for (_, end), (start, _) in zip(gpu, gpu[1:]):
        if start - end > min_us:
            during = [e for e in cpu if e.time_range.start < start and e.time_range.end > end]
            during.sort(key=lambda e: e.time_range.end - e.time_range.start)  # innermost first
            gaps.append(((start - end) / 1e3, " < ".join(e.name for e in during[:3]) or "-"))
    gaps.sort(reverse=True)
    print(f"\n### host gaps in {what}: wall {wall:.1f} ms, GPU busy {busy:.1f} ms, "
          f"{len(gaps)} gaps over {min_us:g} us totalling {sum(g[0] for g in gaps):.2f} ms")
    for ms, name in gaps[:top]:
        print(f"  {ms:7.3f} ms  during {name[:160]}")
    return {"wall_ms": wall, "busy_ms": busy, "gaps": gaps[:top]}


def prefill_tables(model: Any, hf: Any, shape: dict, n: int, reps: int, res: dict[str, Any]) -> None:
    """Kernel tables of one prefill of 4 prompts of ``n`` tokens: the engine's, HF's eager forward's, and the
    projections' cuBLAS GEMMs alone at 4 n rows (the floor both sit on)."""
    from inferflow.engine import SamplingParams

    eng = Engine(model, EngineConfig(max_num_seqs=8, max_model_len=n + 16, max_num_batched_tokens=4 * n,
                                     enable_prefix_caching=False, kv_cache_memory=8.0))
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(10, shape["vocab_size"], (4, n), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def ours() -> None:
        for p in prompts:
            eng.add_request(p, params)
        while eng.has_unfinished():
            eng.step()

    ids = torch.tensor(prompts, device="cuda")

    def theirs() -> None:
        with torch.inference_mode():
            hf(input_ids=ids, use_cache=False, logits_to_keep=1)

    for tag, fn in (("inferflow", ours), ("HF eager", theirs)):
        fn()
        res[f"prefill {tag}"] = print_table(f"prefill, {tag}, 4 x {n} tokens", kernel_table(fn, reps))
    res["prefill idle"] = idle_gaps(ours)
    h, i = shape["hidden_size"], shape["intermediate_size"]
    d, nq, nkv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
    x = torch.randn(4 * n, h, device="cuda", dtype=torch.bfloat16)
    total = 0.0
    print(f"\n### cuBLAS alone at {4 * n} rows, ms (x {shape['num_hidden_layers']} layers)")
    for name, (k, out) in {"qkv": (h, (nq + 2 * nkv) * d), "o": (nq * d, h), "gate_up": (h, 2 * i),
                           "down": (i, h)}.items():
        w = torch.randn(out, k, device="cuda", dtype=torch.bfloat16)
        xi = x if k == h else torch.randn(4 * n, k, device="cuda", dtype=torch.bfloat16)
        ms = kernel_table(lambda: torch.nn.functional.linear(xi, w), reps)
        t = sum(r[1] for r in ms)
        total += t * shape["num_hidden_layers"]
        print(f"  {name}: {t:.3f} ms, {2 * 4 * n * k * out / t / 1e9:.0f} TFLOP/s")
    res["prefill gemm floor ms"] = total
    print(f"  all layers' projections: {total:.2f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--q4", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--kv-cache-memory", type=float, default=8.0, help="GiB of KV cache (large batches x long prompts)")
    ap.add_argument("--prefill", type=int, default=0, help="profile prefill of 4 prompts of this many tokens")
    ap.add_argument("--decode-gaps", type=int, default=0,
                    help="trace this many engine decode steps at the smallest batch: GPU idle gaps over 3 us")
    args = ap.parse_args(argv)
    import transformers

    batches = [int(b) for b in args.batches.split(",")]
    shape = TINY if args.tiny else QWEN3_8B
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    torch.manual_seed(0)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape)).eval()
        torch.set_default_dtype(torch.float32)
    tmp = tempfile.mkdtemp(prefix="profile-gpu-")
    model = load_shared(hf, tmp, "cuda")
    log("model loaded")
    g = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(10, shape["vocab_size"], (b, args.prompt_len), generator=g).tolist() for b in batches}
    ecfg = dict(max_num_seqs=max(batches), max_model_len=args.prompt_len + 160, max_num_batched_tokens=8192,
                enable_prefix_caching=False, kv_cache_memory=args.kv_cache_memory)

    def engine_tables(m: Any, tag: str) -> Engine:
        eng = Engine(m, EngineConfig(**ecfg))
        for b in batches:
            ours_decode(eng, prompts[b], 8, "cuda")
        for b in batches:
            fn = replay_fn(eng, b)
            if fn is not None:
                res[f"{tag} b{b}"] = print_table(f"{tag}, batch {b}, one graph replay", kernel_table(fn, args.replays))
        return eng

    if args.prefill:
        prefill_tables(model, hf, shape, args.prefill, max(1, args.replays // 5), res)
        (out / "profile_gpu.json").write_text(json.dumps(res, indent=1, default=str))
        return 0
    eng = engine_tables(model, "bf16")
    if args.decode_gaps:  # batch-1 decode steps end to end: what the GPU waits on between graph replays
        from inferflow.engine import SamplingParams

        b1 = min(batches)
        for p in prompts[b1]:
            eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=args.decode_gaps + 16, ignore_eos=True))
        for _ in range(8):
            eng.step()

        def steps() -> None:
            for _ in range(args.decode_gaps):
                eng.step()
        res[f"decode gaps b{b1}"] = idle_gaps(steps, 16, f"{args.decode_gaps} decode steps at batch {b1}", 3)
        while eng.has_unfinished():
            eng.step()
    # full engine steps at the largest batch: host work and the GPU's idle gaps, as a trace
    from torch.profiler import ProfilerActivity, profile

    from inferflow.engine import SamplingParams

    b = max(batches)
    for p in prompts[b]:
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(8):
        eng.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(6):
            eng.step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(out / f"engine_b{b}.json"))
    steps = [e for e in prof.events() if e.name.startswith("cudaGraphLaunch")]
    res["engine_step_cpu_top"] = [(e.key, e.cpu_time_total / 6e3) for e in sorted(
        prof.key_averages(), key=lambda e: -e.cpu_time_total)[:25]]
    print(f"\n### engine steps at batch {b}: {len(steps)} graph launches in 6 steps; CPU time per step (ms):")
    for k, ms in res["engine_step_cpu_top"]:
        print(f"  {ms:8.3f}  {k[:100]}")
    while eng.has_unfinished():
        eng.step()
    res["gemm"] = gemm_table(shape, batches)
    if args.q4:
        del eng
        qm = load_shared(hf, tmp, "cuda", quant="q4_0")
        log("q4 model loaded")
        engine_tables(qm, "q4_0")
    (out / "profile_gpu.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
