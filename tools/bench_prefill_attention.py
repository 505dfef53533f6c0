"""Prefill attention of whole new sequences, three ways, on one GPU: what the paged backend's choices cost.

    python tools/bench_prefill_attention.py [--cases 4x2048,16x512,ragged] [--iters 20]
    python tools/bench_prefill_attention.py --first-calls 301,517,1029   # the cost of each new sequence length

For packed q [N, 32, 128] and k/v [N, 8, 128] (bf16, the Qwen3-8B layer's heads):
- ``per_seq``: one causal SDPA call per sequence on [1, H, T, D] views, the outputs copied into one buffer (the
  backend before adjacent equal-length sequences were batched);
- ``batched``: one SDPA call on [B, H, T, D] views (``PagedAttentionBackend._run``; equal lengths only);
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` on the packed stream (flash attention with cumulative
  lengths; any lengths), where this torch has it.
Prints µs per layer call (median of ``--iters`` timed with CUDA events) and each form's max |diff| against
``per_seq``. No timing is asserted anywhere.
"""
from __future__ import annotations

import argparse
import inspect
import statistics

import torch
import torch.nn.functional as F

H, HKV, D = 32, 8, 128


def per_seq(q, k, v, lens):
    out, s = torch.empty_like(q), 0
    for n in lens:
        o = F.scaled_dot_product_attention(q[s:s + n].transpose(0, 1)[None], k[s:s + n].transpose(0, 1)[None],
                                           v[s:s + n].transpose(0, 1)[None], is_causal=True, enable_gqa=True)
        out[s:s + n] = o[0].transpose(0, 1)
        s += n
    return out


def batched(q, k, v, lens):
    b, t = len(lens), lens[0]
    qb, kb, vb = (x.unflatten(0, (b, t)).transpose(1, 2) for x in (q, k, v))
    o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
    return o.transpose(1, 2).reshape(q.shape)


def varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, "no torch.nn.attention.varlen"
    params = inspect.signature(varlen_attn).parameters
    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        kw["enable_gqa"] = True

    def run(q, k, v, lens):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
        return varlen_attn(q, k, v, cu, cu, max(lens), max(lens), **kw)
    return run, f"varlen_attn{tuple(params)}"


def time_us(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def first_calls(lengths: list[int], vfn) -> None:
    """Wall ms of the first and the second call at each new sequence length: what a backend pays per new shape
    (cuDNN builds an execution plan per shape; flash kernels have none to build)."""
    import time

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run(q, k, v, lens):
            with sdpa_kernel([backend]):
                return per_seq(q, k, v, lens)
        return run

    forms = [("sdpa default", lambda q, k, v, lens: per_seq(q, k, v, lens)),
             ("sdpa cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)), ("sdpa flash", sdpa(SDPBackend.FLASH_ATTENTION))]
    if vfn is not None:
        forms.append(("varlen", vfn))
    print("| form | " + " | ".join(f"T={t} first / second ms" for t in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for i, (name, fn) in enumerate(forms):
        row = []
        for t in lengths:
            t = t + i  # a length no earlier form has seen either
            q = torch.randn(t, H, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            ms = []
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(q, k, v, [t])
                torch.cuda.synchronize()
                ms.append((time.perf_counter() - t0) * 1e3)
            row.append(f"{ms[0]:.1f} / {ms[1]:.2f}")
        print(f"| {name} | " + " | ".join(row) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="4x2048,16x512,ragged")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--first-calls", default="", help="lengths, e.g. 301,517,1029: first vs second call per shape")
    args = ap.parse_args()
    vfn, vdesc = varlen_fn()
    print(f"torch {torch.__version__}; {vdesc}")
    if args.first_calls:
        first_calls([int(x) for x in args.first_calls.split(",")], vfn)
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| case | per_seq µs | batched µs | varlen µs | batched max diff | varlen max diff |")
    print("|---|---:|---:|---:|---:|---:|")
    for case in args.cases.split(","):
        if case == "ragged":
            lens = [2048, 1024, 1536, 512, 768, 256, 1280, 768]
        else:
            b, t = map(int, case.split("x"))
            lens = [t] * b
        n = sum(lens)
        q = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        ref = per_seq(q, k, v, lens)
        row = [case, f"{time_us(lambda: per_seq(q, k, v, lens), args.iters):.0f}"]
        diffs = []
        for name, fn in (("batched", batched if len(set(lens)) == 1 else None), ("varlen", vfn)):
            if fn is None:
                row.append("-")
                diffs.append("-")
                continue
            try:
                diffs.append(f"{(fn(q, k, v, lens).float() - ref.float()).abs().max().item():.3g}")
                row.append(f"{time_us(lambda fn=fn: fn(q, k, v, lens), args.iters):.0f}")
            except Exception as e:  # noqa: BLE001 - report and go on
                row.append(f"error: {type(e).__name__}: {str(e)[:80]}")
                diffs.append("-")
        print("| " + " | ".join(row + diffs) + " |", flush=True)


if __name__ == "__main__":
    main()
