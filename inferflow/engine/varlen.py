"""Causal attention of several whole new sequences of different lengths in ONE call: torch's flash-attention
``varlen_attn`` over the packed stream, with cumulative sequence offsets.

A prefill step of prompts of different lengths otherwise runs one attention call per prompt; for short prompts
those calls are launch-bound (H200, bf16, 8 prompts of 256-2048 tokens, 32 q / 8 kv heads of 128: 778 µs per
layer as per-prompt calls against 591 µs as one varlen call, ``tools/bench_prefill_attention.py``). Equal-length
runs keep the batched SDPA call (cuDNN's kernel: 297 µs against varlen's 588 µs for 4 x 2048).

Only CUDA tensors in fp16 / bf16 qualify (the kernel is flash attention's); the signature moved between torch
releases (``is_causal`` in 2.10, ``window_size`` from 2.11, ``enable_gqa`` from 2.12), so it is read once.
"""
from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any, Callable

import torch

VarlenFn = Callable[..., torch.Tensor]


@lru_cache(maxsize=1)
def _impl() -> tuple[VarlenFn, frozenset[str]] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def usable(q: torch.Tensor, head_dim: int) -> bool:
    """Whether ``varlen_causal`` can take these queries (CUDA, fp16/bf16, head_dim a multiple of 8 up to 256, a
    torch whose ``varlen_attn`` takes a ``scale``: 2.11 on)."""
    impl = _impl()
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and impl is not None and "scale" in impl[1])


def varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq: torch.Tensor, max_len: int, scale: float,
                  fn: VarlenFn | None = None) -> torch.Tensor:
    """q [N, H, D], k/v [N, Hkv, D] packed whole sequences; ``cu_seq`` [B+1] int32 offsets on q's device.
    Causal attention within each sequence -> [N, H, D]. ``fn`` replaces torch's kernel (tests on the CPU)."""
    impl = _impl()
    if fn is None:
        if impl is None:
            raise RuntimeError("varlen attention: this torch has no torch.nn.attention.varlen")
        fn = impl[0]
    params = impl[1] if impl is not None else frozenset()
    kw: dict[str, Any] = {"scale": scale}
    if "is_causal" in params:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)  # (left, right): every earlier key, no later one
    if "enable_gqa" in params and q.shape[1] != k.shape[1]:
        kw["enable_gqa"] = True
    return fn(q, k, v, cu_seq, cu_seq, max_len, max_len, **kw)


def warm_up(device: torch.device, dtype: torch.dtype) -> None:
    """One tiny call, so that the kernel's first use (~4-5 s of lazy module loading on an H200 with torch 2.11)
    happens when the engine starts, not in the first step that serves prompts of many lengths."""
    q = torch.zeros(2, 1, 64, device=device, dtype=dtype)
    if usable(q, 64):
        varlen_causal(q, q, q, torch.tensor([0, 1, 2], dtype=torch.int32, device=device), 1, 0.125)
