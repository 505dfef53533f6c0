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
import logging
from functools import lru_cache
from typing import Any, Callable

import torch

VarlenFn = Callable[..., torch.Tensor]
log = logging.getLogger(__name__)


@lru_cache(maxsize=1)
def _impl() -> tuple[VarlenFn, frozenset[str]] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


_failed: set[int] = set()  # CUDA devices where the kernel raised (warm_up): never tried there again


@lru_cache(maxsize=8)
def _flash_capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 0)  # flash attention's kernels: Ampere on


def usable(q: torch.Tensor, head_dim: int) -> bool:
    """Whether ``varlen_causal`` can take these queries (CUDA on an Ampere or newer GPU, fp16/bf16, head_dim a
    multiple of 8 up to 256, a torch whose ``varlen_attn`` takes a ``scale``: 2.11 on)."""
    if q.device.type != "cuda":  # before _impl(): importing torch's varlen module costs ~144 MB of RSS
        return False
    impl = _impl()
    if impl is None or "scale" not in impl[1]:
        return False
    index = _index(q.device)
    return (q.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256
            and index not in _failed and _flash_capable(index))


def _index(device: torch.device) -> int:
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq: torch.Tensor, max_len: int, scale: float,
                  fn: VarlenFn | None = None, *, cu_seq_k: torch.Tensor | None = None,
                  max_k: int | None = None) -> torch.Tensor:
    """q [N, H, D], k/v [N, Hkv, D] packed whole sequences; ``cu_seq`` [B+1] int32 offsets on q's device.
    Causal attention within each sequence -> [N, H, D]. ``fn`` replaces torch's kernel (tests on the CPU).

    ``cu_seq_k`` / ``max_k``: sequences whose keys outnumber their queries (prefill chunks on cached keys, k/v
    [Nk, Hkv, D] packed per sequence); flash attention aligns the causal limit bottom-right, so query i of a
    sequence with q_len queries and k_len keys sees keys 0 .. k_len - q_len + i."""
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
    if cu_seq_k is None:
        cu_seq_k, max_k = cu_seq, max_len
    return fn(q, k, v, cu_seq, cu_seq_k, max_len, max_k, **kw)


def warm_up(device: torch.device, dtype: torch.dtype) -> None:
    """One tiny call, so that the kernel's first use (~4-5 s of lazy module loading on an H200 with torch 2.11)
    happens when the engine starts, not in the first step that serves prompts of many lengths."""
    q = torch.zeros(2, 1, 64, device=device, dtype=dtype)
    if usable(q, 64):
        probe(q)


def probe(q: torch.Tensor) -> bool:
    """One call on ``q`` [2, 1, 64] (two one-token sequences); False, and the kernel off for q's device, if it
    raises (a torch or GPU without it: prompts of many lengths then attend one call each)."""
    try:
        varlen_causal(q, q, q, torch.tensor([0, 1, 2], dtype=torch.int32, device=q.device), 1, 0.125)
        return True
    except Exception as e:  # noqa: BLE001 - any failure of the optional kernel must not stop the engine
        _failed.add(_index(q.device))
        log.warning("varlen attention unavailable on %s (%s: %s); prompts of many lengths attend one call each",
                    q.device, type(e).__name__, e)
        return False
