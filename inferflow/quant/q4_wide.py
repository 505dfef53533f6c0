"""4-bit matmuls of more rows than most CUDA kernels take (``triton_soa.CUDA_MAX_ROWS`` < rows <=
``triton_soa.GEMM_MAX_ROWS``) inside CUDA graphs: Triton's dequant-fused GEMM, the weight decoded into a buffer
and one cuBLAS matmul, the rows in chunks of CUDA_MAX_ROWS (the CUDA kernels where they timed faster), or, on
Hopper, the warpgroup-MMA GEMM (native/q4_wgmma.cu), whichever the graph warm-up timed fastest for the key.

Such steps are batched decode at 65-256 sequences, short prefills replayed as graphs (``graph_prefill_tokens``)
and mixed steps. Run eagerly, they take the fused GEMM: a one-prompt prefill of 96-256 tokens is bound by the
host, and there one launch per matmul beat two (docs/benchmarks.md, 2026-12-01 03:33 UTC). Inside a graph a
launch costs nothing, and on an H200 decode + cuBLAS took 1.3-2.1x less GPU time per Qwen3-8B layer at 96-256
rows than the autotuned fused GEMM. Timing per key, not a fixed row bound, keeps the fused GEMM wherever a GPU
or shape favours it.

The choice is made only inside the graph warm-up (model/gpu_gemv.py's ``selecting`` block, which
engine/cuda_graphs.py enters before each capture), so that the decode buffer exists before the capture that
bakes its address in. Choices persist like the other kernel choices (native/choices.py).
``INFERFLOW_Q4_WIDE=0`` (read at each call: an A/B run captures one engine with each) keeps the fused GEMM.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Callable

import torch

from ..native import choices
from . import cuda_q4

FUSED, DECODE, CHUNKS, WGMMA = "fused", "decode", "chunks", "wgmma"

log = logging.getLogger(__name__)
_lock = threading.Lock()
_choice: dict[tuple, str] = {}
# the candidates' sources: the chunks run the CUDA kernels (cuda_q4.py's) where those timed faster
STORE = choices.ChoiceStore("q4_wide", [Path(__file__), Path(__file__).with_name("triton_soa.py"),
                                        Path(__file__).with_name("triton_q4_gemm.py"), *cuda_q4.STORE.sources])


def enabled() -> bool:
    return os.environ.get("INFERFLOW_Q4_WIDE", "1") not in ("0", "false", "off")


def _selecting() -> bool:
    from ..model import gpu_gemv

    return gpu_gemv.selecting_now()


def pick(x2: torch.Tensor, n: int, k: int, kind: str, bias: torch.Tensor | None,
         calls: dict[str, Callable[[], torch.Tensor]]) -> str:
    """Which of ``calls`` (by name: :data:`FUSED`, and :data:`DECODE`, :data:`CHUNKS`) runs this matmul
    (activations ``x2`` [M, K], a 4-bit [n, k] weight): the timed choice for its key inside CUDA graphs and their
    warm-up; FUSED elsewhere, and for a key not timed yet anywhere but in the warm-up."""
    if x2.device.type != "cuda" or not enabled():
        return FUSED
    capturing = torch.cuda.is_current_stream_capturing()
    if not capturing and not _selecting():
        return FUSED  # an eager step: bound by the host (module docstring)
    key = (x2.shape[0], n, k, kind, x2.dtype, bias is not None, WGMMA in calls, x2.device)
    hit = _choice.get(key)
    if hit is not None or capturing:
        return hit if hit in calls else FUSED
    with _lock:
        if key not in _choice:
            got = STORE.get(key[:7], x2.device)
            if got not in calls:
                got = _time(calls)
                STORE.put(key[:7], x2.device, got)
            _choice[key] = got
            log.debug("4-bit matmul %s in graphs: %s", key[:7], got)
    return _choice[key]


def _time(calls: dict[str, Callable[[], torch.Tensor]]) -> str:
    """The fastest of ``calls`` as CUDA-graph replays with L2 flushed (how a decode step runs them)."""
    from .triton_q4 import _flushed_graph_ms

    for call in calls.values():  # Triton's autotuner and the CUDA kernels' choices first, outside the timed graphs
        call()
    try:
        ms = {name: _flushed_graph_ms(call) for name, call in calls.items()}
    except RuntimeError as e:  # a timer problem must not fail the step: the fused GEMM, as before
        log.warning("4-bit matmul timing failed (%s); the fused GEMM runs", e)
        return FUSED
    return min(ms, key=ms.get)
