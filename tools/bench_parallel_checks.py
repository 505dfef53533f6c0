"""The correctness checks of tools/bench_parallel.py: a placement's logits and greedy tokens against the
one-device model (``agreement``) and sharding while loading a real model folder (``load_check``).
"""
from __future__ import annotations

import gc

import torch

from bench_parallel_runs import parse_placement, random_prompts


def agreement(base, part, a, vocab: int) -> dict:
    """Logits on a ragged batch (relative max |diff|, argmax agreement) and greedy tokens."""
    seqs = [s[:n] for s, n in zip(random_prompts(4, 96, vocab, 7), (17, 96, 40, 63))]
    ref, got = base.logits(seqs).float(), part.logits(seqs).float()
    mask = torch.zeros(ref.shape[:2], dtype=torch.bool, device=ref.device)
    for i, s in enumerate(seqs):
        mask[i, :len(s)] = True
    ref, got = ref[mask], got.to(ref.device)[mask]
    rel = ((ref - got).abs().max() / ref.abs().max()).item()
    argmax = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
    prompt = seqs[1][:32]
    want = base.generate_ids(prompt, max_new_tokens=a.greedy_tokens, stop_ids=set())
    have = part.generate_ids(prompt, max_new_tokens=a.greedy_tokens, stop_ids=set())
    res = {"logits_rel_diff": rel, "argmax_agree": argmax, "logits_ok": rel <= a.tol,
           "greedy_same": want == have, "greedy_first_diff": None, "greedy_near_tie": None}
    if want != have:
        k = next(i for i, (x, y) in enumerate(zip(want, have)) if x != y)
        row = base.logits(prompt + want[:k]).float()[-1]
        gap = (row[want[k]] - row[have[k]]).item() / row.std().item()
        res["greedy_first_diff"], res["greedy_near_tie"] = k, gap <= a.tie
    return res


def load_check(a, names: list[str], device: torch.device, dtype: torch.dtype) -> dict:
    """Sharding while loading on this device: ``load_parallel`` of a real model folder against ``inferflow.load``
    (logits; the device memory the shard load peaked at, as a fraction of the whole model's bytes)."""
    import inferflow
    from inferflow.parallel.apply import load_parallel

    whole = inferflow.load(a.load_check, dtype=dtype, device=device)
    nbytes = sum(t.numel() * t.element_size() for t in [*whole.net.parameters(), *whole.net.buffers()])
    vocab = int(whole.params.get("vocab_size") or 100)
    seqs = [s[:n] for s, n in zip(random_prompts(2, 48, vocab, 11), (48, 29))]
    ref = whole.logits(seqs).float()
    out = {}
    for name in names:
        cfg = parse_placement(name)
        if cfg is None:
            continue
        gc.collect()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        part = load_parallel(a.load_check, cfg, dtype=dtype, device=device)
        peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
        got = part.logits(seqs).float().to(ref.device)
        mask = torch.zeros(ref.shape[:2], dtype=torch.bool, device=ref.device)
        for i, sq in enumerate(seqs):
            mask[i, :len(sq)] = True
        rel = ((ref[mask] - got[mask]).abs().max() / ref[mask].abs().max()).item()
        out[name] = {"logits_rel_diff": rel, "logits_ok": rel <= a.tol, "whole_gib": round(nbytes / 2**30, 3),
                     "shard_load_peak_gib": round(peak / 2**30, 3), "peak_fraction": round(peak / nbytes, 3)}
        del part
    del whole
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out
