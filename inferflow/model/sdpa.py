"""``F.scaled_dot_product_attention`` with cuDNN's backend kept for shapes that recur.

On CUDA, torch prefers cuDNN's attention, which builds an execution plan for every new shape: 38-64 ms each on an
H200 (``tools/bench_prefill_attention.py --first-calls``). A serving step meets a new sequence length with nearly
every prompt; 256 prompts of distinct lengths queued at once spent ~13 s building plans (TTFT median 15 s against
4.4 s without them). Flash attention's kernels have no per-shape set-up, so a shape runs on flash (or the
memory-efficient kernel, or math) until it has been seen ``HOT_CALLS`` times; then, if it holds at least
``MIN_TOKENS`` queries, cuDNN may take it, for at most ``MAX_HOT`` shapes per process, so plan builds stay bounded.
cuDNN pays off only on big batched calls: on 4 x 2048 tokens a prefill ran at 42.3k tok/s with it and 40.8k
without; on single sequences of 300-2000 tokens flash was as fast or faster (0.13-0.25 against 0.25-0.29 ms).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

HOT_CALLS = 72    # calls of one shape (2 forwards of a 36-layer model) before its cuDNN plan is worth building
MIN_TOKENS = 4096  # queries (batch x length) of a call below which cuDNN is never worth a plan
MAX_HOT = 16      # shapes that may get a cuDNN plan, per process
MAX_TRACKED = 4096  # shapes counted at once; past that the cold counts start over (a long-running server's memory)

_counts: dict[tuple, int] = {}
_hot: set[tuple] = set()


@lru_cache(maxsize=1)
def _no_cudnn() -> list:
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def allow_cudnn(key: tuple) -> bool:
    """Count one call of shape ``key``; True when cuDNN may run it (a recurring shape within the budget)."""
    if key in _hot:
        return True
    n = _counts.get(key, 0) + 1
    if n >= HOT_CALLS and len(_hot) < MAX_HOT:
        _hot.add(key)
        _counts.pop(key, None)
        return True
    if len(_counts) >= MAX_TRACKED and key not in _counts:
        _counts.clear()
    _counts[key] = n
    return False


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, **kw)``; on CUDA without cuDNN unless the shape recurs."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **kw)
    mask = kw.get("attn_mask")
    key = (tuple(q.shape), tuple(k.shape), q.dtype, bool(kw.get("is_causal")),
           None if mask is None else (tuple(mask.shape), mask.dtype))
    if q.shape[-2] * (q.shape[0] if q.dim() == 4 else 1) >= MIN_TOKENS and allow_cudnn(key):
        return F.scaled_dot_product_attention(q, k, v, **kw)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(_no_cudnn()):
        return F.scaled_dot_product_attention(q, k, v, **kw)
