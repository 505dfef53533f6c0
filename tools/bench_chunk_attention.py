"""Prefill chunks on cached keys through the paged backend, two ways, on one GPU: a gather, a [Tq, Tk] mask and a
masked SDPA call per chunk, against one varlen flash call over all rows' gathered keys (``paged_backend``).

    python tools/bench_chunk_attention.py [--cases prefix16,prefix64,long,mixed] [--forwards 5]

Each case is one engine step of (new tokens, keys) rows, decode rows (q_len 1) included, on Qwen3-8B's attention
heads (32 q / 8 kv of 128, bf16, 16-token blocks scattered over the pool). A forward builds the backend's per-step
index tensors once and calls ``self_attention`` for 36 layers (K/V write included), as a model does; µs per layer
call are the median over ``--forwards`` timed forwards (CUDA events) after two untimed ones. Also prints the max
|diff| between the two paths. No timing is asserted anywhere.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from inferflow.engine import paged_backend as pb
from inferflow.engine.kv_cache import KVLayer, PagedKVCache
from inferflow.model.context import ForwardContext

H, HKV, D, BS, LAYERS = 32, 8, 128, 16, 36
CASES = {  # name -> [(new tokens, keys)] per row
    "prefix16": [(128, 1152)] * 16,           # prefix-cache hits: 1024 cached tokens, 128 new each
    "prefix64": [(64, 1088)] * 64,
    "long": [(2048, 16384)],                  # the 8th 2048-token chunk of a long prompt
    "mixed": [(512, 2560)] * 4 + [(1, 1024)] * 32,  # chunks and decode rows in one step
}


def run_case(rows: list[tuple[int, int]], forwards: int, varlen_on: bool, g: torch.Generator):
    blocks = sum(-(-k // BS) for _, k in rows)
    cache = PagedKVCache([KVLayer(0, HKV, D)], blocks + 8, BS, dtype="bfloat16", compute_dtype=torch.bfloat16,
                         device="cuda")
    st = cache._dev[0]
    st.k.normal_(generator=g)
    st.v.normal_(generator=g)
    perm = torch.randperm(blocks, generator=g, device="cuda").tolist()
    tables, at = [], 0
    for _, k in rows:
        n = -(-k // BS)
        tables.append(perm[at:at + n])
        at += n
    slots = cache.slot_mapping(tables, [k - q for q, k in rows], [q for q, _ in rows])
    n = sum(q for q, _ in rows)
    q, k, v = (torch.randn(n, h, D, device="cuda", dtype=torch.bfloat16, generator=g) for h in (H, HKV, HKV))
    orig, pb.VARLEN_CHUNKS = pb.VARLEN_CHUNKS, varlen_on
    try:
        times, out = [], None
        for i in range(forwards + 2):
            ctx = ForwardContext(positions=torch.zeros(n, dtype=torch.long), q_lens=[a for a, _ in rows],
                                 k_lens=[b for _, b in rows], backend=None)
            backend = pb.PagedAttentionBackend(cache, tables, slots)
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(LAYERS):
                out = backend.self_attention(0, q, k, v, ctx, causal=True, scale=D ** -0.5)
            e1.record()
            torch.cuda.synchronize()
            if i >= 2:
                times.append(e0.elapsed_time(e1) * 1000 / LAYERS)
    finally:
        pb.VARLEN_CHUNKS = orig
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--forwards", type=int, default=5)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print("| case | rows (new tokens x keys) | per chunk µs/layer | one varlen call µs/layer | ratio | max abs diff |")
    print("|---|---|---:|---:|---:|---:|")
    for name in args.cases.split(","):
        rows = CASES[name]
        desc = ", ".join(f"{rows.count(r)} x ({r[0]}, {r[1]})" for r in dict.fromkeys(rows))
        t_each, o_each = run_case(rows, args.forwards, False, torch.Generator("cuda").manual_seed(0))
        t_var, o_var = run_case(rows, args.forwards, True, torch.Generator("cuda").manual_seed(0))
        diff = (o_each.float() - o_var.float()).abs().max().item()
        print(f"| {name} | {desc} | {t_each:.1f} | {t_var:.1f} | {t_each / t_var:.2f}x | {diff:.2e} |", flush=True)


if __name__ == "__main__":
    main()
