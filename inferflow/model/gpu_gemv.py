"""A Triton GEMV for 16-bit weights and 1-4 activation rows (decode steps), picked per shape where it beats cuBLAS.

cuBLAS runs M=1 GEMMs of decode-shaped weights (4096 x 4096, 6144 x 4096, ...) well above their weight-read time on
an H200 (tiles padded to 8+ rows, split-K reduce kernels; tools/bench_gemv_gpu.py), and a decode step is nearly all
weight reads. Here a program owns BLOCK_N output columns for every row, so the weight is read exactly once: wide
16-byte loads along K, float32 products accumulated elementwise (or summed each step) and reduced once after the K
loop, optionally split over K with a deterministic second pass (partials summed in a fixed order).

Selection: inside :func:`selecting` (the engine's eager warm-up of each CUDA-graph bucket, engine/cuda_graphs.py),
the first call of a (rows, N, K, dtype, bias) key times cuBLAS (F.linear) against each config on the real weight as
a decode step runs them (in CUDA graphs, the weight never in L2: time_cuda) and caches the fastest; Triton only
where it beats cuBLAS by ``MARGIN``. The choice is used only inside a CUDA-graph capture (the decode graphs it was
timed for); eager calls (prefill heads, eager fallbacks) and unseen keys keep cuBLAS, so nothing is ever timed in
the middle of serving, where other steps' work is in flight.
INFERFLOW_GPU_GEMV=0 (or ``ENABLED = False``) keeps cuBLAS everywhere, for A/B runs.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..native import choices

ENABLED = os.environ.get("INFERFLOW_GPU_GEMV", "1") != "0"
MAX_ROWS = int(os.environ.get("INFERFLOW_GPU_GEMV_ROWS", "4"))  # rows up to which Triton is tried (A/B runs)
MARGIN = 0.03  # Triton must be this much faster than cuBLAS: a near tie keeps the vendor path
_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class Config:
    block_n: int
    block_k: int
    warps: int = 4
    split_k: int = 1
    stages: int = 1
    sum_each: bool = False  # reduce over K every step (few registers: more rows) instead of after the loop

    def fits(self, rows: int) -> bool:
        """float32 accumulator registers per thread stay moderate (elementwise accumulation keeps a tile a row)."""
        acc = rows * (1 if self.sum_each else self.block_n * self.block_k // (32 * self.warps))
        return acc + self.block_n * self.block_k // (32 * self.warps) <= 96


# A small set (each (config, rows) pair is one compile at first use): the configs within ~3% of the best for some
# Qwen3-8B decode shape at 1-2 rows on an H200 out of 19 swept (tools/bench_gemv_gpu.py; M=1 in-graph us, cuBLAS ->
# picked: qkv 15.7 -> 14.2, o 12.7 -> 10.3, gate_up 49.1 -> 47.4, down 29.9 -> 25.2, head 297 -> 276; at 3-4 rows
# cuBLAS wins), and one split-K for weights of few output rows (no swept shape: its 2nd launch costs more there).
CONFIGS: tuple[Config, ...] = (
    Config(4, 512), Config(4, 512, 2), Config(8, 512), Config(4, 1024), Config(4, 1024, sum_each=True),
    Config(16, 512, sum_each=True), Config(16, 1024, 8, sum_each=True), Config(8, 512, split_k=4),
)
INTERP_CONFIGS: tuple[Config, ...] = (Config(4, 32), Config(8, 16, split_k=3), Config(4, 32, sum_each=True))

log = logging.getLogger(__name__)
_choice: dict[tuple, Config | None] = {}
_MISSING = object()
_selecting = 0  # > 0 inside selecting()


@triton.jit
def _gemv(x_ptr, w_ptr, b_ptr, y_ptr, p_ptr, N, K, k_split, sxm, swn, HAS_BIAS: tl.constexpr, M: tl.constexpr,
          SPLIT: tl.constexpr, EVEN_K: tl.constexpr, SUM_EACH: tl.constexpr, BLOCK_N: tl.constexpr,
          BLOCK_K: tl.constexpr):
    """y[m, n] = sum_k x[m, k] w[n, k] (+ b[n]) for M <= 4 rows; program (n block, k split). SPLIT > 1: float32
    partials [SPLIT, M, N] into p_ptr instead (summed by _split_sum)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.minimum(rn, N - 1).to(tl.int64)  # columns past N re-read the last weight row: loads stay unmasked
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_split
    wp = w_ptr + rw[:, None] * swn + (k_lo + rk)[None, :]
    xp = x_ptr + k_lo + rk
    if SUM_EACH:
        a0 = tl.zeros([BLOCK_N], tl.float32)
        a1 = tl.zeros([BLOCK_N], tl.float32)
        a2 = tl.zeros([BLOCK_N], tl.float32)
        a3 = tl.zeros([BLOCK_N], tl.float32)
    else:
        a0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        a1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        a2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        a3 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, k_split, BLOCK_K):
        if EVEN_K:
            w = tl.load(wp, eviction_policy="evict_first").to(tl.float32)
            x0 = tl.load(xp).to(tl.float32)
            if M > 1:
                x1 = tl.load(xp + sxm).to(tl.float32)
            if M > 2:
                x2 = tl.load(xp + 2 * sxm).to(tl.float32)
            if M > 3:
                x3 = tl.load(xp + 3 * sxm).to(tl.float32)
        else:
            km = (k_lo + k0 + rk) < K
            w = tl.load(wp, mask=km[None, :], other=0.0, eviction_policy="evict_first").to(tl.float32)
            x0 = tl.load(xp, mask=km, other=0.0).to(tl.float32)
            if M > 1:
                x1 = tl.load(xp + sxm, mask=km, other=0.0).to(tl.float32)
            if M > 2:
                x2 = tl.load(xp + 2 * sxm, mask=km, other=0.0).to(tl.float32)
            if M > 3:
                x3 = tl.load(xp + 3 * sxm, mask=km, other=0.0).to(tl.float32)
        if SUM_EACH:
            a0 += tl.sum(w * x0[None, :], 1)
            if M > 1:
                a1 += tl.sum(w * x1[None, :], 1)
            if M > 2:
                a2 += tl.sum(w * x2[None, :], 1)
            if M > 3:
                a3 += tl.sum(w * x3[None, :], 1)
        else:
            a0 += w * x0[None, :]
            if M > 1:
                a1 += w * x1[None, :]
            if M > 2:
                a2 += w * x2[None, :]
            if M > 3:
                a3 += w * x3[None, :]
        wp += BLOCK_K
        xp += BLOCK_K
    if not SUM_EACH:
        a0 = tl.sum(a0, 1)
        a1 = tl.sum(a1, 1)
        a2 = tl.sum(a2, 1)
        a3 = tl.sum(a3, 1)
    nm = rn < N
    if SPLIT == 1:
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)
            a0 += bias
            a1 += bias
            a2 += bias
            a3 += bias
        out = y_ptr.dtype.element_ty
        tl.store(y_ptr + rn, a0.to(out), mask=nm)
        if M > 1:
            tl.store(y_ptr + N + rn, a1.to(out), mask=nm)
        if M > 2:
            tl.store(y_ptr + 2 * N + rn, a2.to(out), mask=nm)
        if M > 3:
            tl.store(y_ptr + 3 * N + rn, a3.to(out), mask=nm)
    else:
        pp = p_ptr + pid_k * M * N + rn
        tl.store(pp, a0, mask=nm)
        if M > 1:
            tl.store(pp + N, a1, mask=nm)
        if M > 2:
            tl.store(pp + 2 * N, a2, mask=nm)
        if M > 3:
            tl.store(pp + 3 * N, a3, mask=nm)


@triton.jit
def _split_sum(p_ptr, b_ptr, y_ptr, MN, N, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum of the SPLIT float32 partials in split order (deterministic) + bias, in y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(p_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cfg: Config) -> torch.Tensor:
    """x [M <= 4, K] @ w[N, K]^T (+ b) with config ``cfg`` (no checks beyond contiguity along K)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    step = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k  # K per split, whole tiles
    part = y if cfg.split_k == 1 else torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
    bias = b if b is not None else y  # never read without HAS_BIAS
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    _gemv[grid](x, w, bias, y, part, n, k, step, x.stride(0), w.stride(0), HAS_BIAS=b is not None, M=m,
                SPLIT=cfg.split_k, EVEN_K=step * cfg.split_k == k, SUM_EACH=cfg.sum_each, BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, num_warps=cfg.warps, num_stages=cfg.stages)
    if cfg.split_k > 1:
        block = 1024
        _split_sum[(triton.cdiv(m * n, block),)](part, bias, y, m * n, n, HAS_BIAS=b is not None,
                                                 SPLIT=cfg.split_k, BLOCK=block)
    return y


def _interp() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def configs(rows: int) -> list[Config]:
    return [c for c in (INTERP_CONFIGS if _interp() else CONFIGS) if c.fits(rows)]


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def time_cuda(fns: Sequence[Callable[[torch.Tensor], object]], w: torch.Tensor, reps: int = 7) -> list[float]:
    """Microseconds per call of each ``fn(weight)`` as a decode step's CUDA graph runs it: a graph per fn of calls
    over rotating copies of ``w`` (together > 2x the L2 cache: every call reads its weight from memory, as a step
    through the layers does), the graphs replayed interleaved (A, B, C, A, ...), medians. Host launch costs, which
    inside a graph don't exist, don't count."""
    l2 = torch.cuda.get_device_properties(w.device).L2_cache_size
    ws = [w] + [w.clone() for _ in range(-(-2 * l2 // max(w.nbytes, 1)))]
    calls = len(ws) * max(1, -(-16 // len(ws)))  # at least 16 calls a replay, every copy as often
    graphs: list[torch.cuda.CUDAGraph | None] = []
    g = None
    for f in fns:
        try:
            f(w)  # compile, warm (outside the capture)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(calls):
                    f(ws[i % len(ws)])
            graphs.append(g)
        except Exception:  # noqa: BLE001 - a candidate that cannot run in a graph: never chosen
            torch.cuda.synchronize()
            graphs.append(None)
    ms: list[list[float]] = [[] if g is not None else [float("inf")] for g in graphs]
    for _ in range(reps):
        for g, out in zip(graphs, ms):
            if g is None:
                continue
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e))
    del graphs, ws, g
    # cuBLAS keeps one workspace per (handle, stream), allocated at first use: here inside a capture, so from the
    # timing graphs' private pool, which dies with them. Left cached, the engine's next capture on the same stream
    # would bake that address into its decode graph, and a later release of the workspace (torch.compile's graphs
    # clear them) frees memory the graph still writes: an illegal address (seen on an H200 after HF's compiled runs)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        torch.cuda.synchronize()
        clear()
    return [statistics.median(m) * 1e3 / calls for m in ms]


timer: Callable[[Sequence[Callable[[torch.Tensor], object]], torch.Tensor], list[float]] = time_cuda  # tests: fake


def select(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[Config | None, list[float]]:
    """The fastest of cuBLAS (None) and the configs that match F.linear on these operands, and all the timings
    (cuBLAS first; inf for a config that failed to compile or run, or gave wrong results)."""
    ref = F.linear(x, w, b).float()
    cands: list[Config] = []
    for c in configs(x.shape[0]):
        try:
            if _matches(gemv(x, w, b, c), ref):
                cands.append(c)
        except Exception:  # noqa: BLE001 - a config this GPU / Triton cannot run (resources): not a candidate
            pass
    ts = timer([lambda w_: F.linear(x, w_, b)] + [lambda w_, c=c: gemv(x, w_, b, c) for c in cands], w)
    if ts[0] == float("inf"):  # cuBLAS itself could not be timed: no basis for a choice
        return None, ts[:1] + [float("inf")] * len(configs(x.shape[0]))
    best = min(range(len(cands)), key=lambda i: ts[i + 1], default=None)
    pick = cands[best] if best is not None and ts[best + 1] < ts[0] * (1 - MARGIN) else None
    bycfg = {c: t for c, t in zip(cands, ts[1:])}
    return pick, [ts[0]] + [bycfg.get(c, float("inf")) for c in configs(x.shape[0])]


@contextlib.contextmanager
def selecting():
    """Calls inside this block time and cache the choice for keys not yet seen (the engine's graph warm-up)."""
    global _selecting
    _selecting += 1
    try:
        yield
    finally:
        _selecting -= 1


def selecting_now() -> bool:
    """Whether this is inside :func:`selecting` (other selections, e.g. quant/q4_wide.py, time there too)."""
    return _selecting > 0


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor | None:
    """x @ w^T (+ b) through the Triton GEMV inside a CUDA-graph capture where it was timed faster for this shape
    (in :func:`selecting`); None: use F.linear."""
    if not ENABLED or x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.dtype not in _DTYPES \
            or w.dtype != x.dtype or w.dim() != 2 or (b is not None and b.dtype != x.dtype) \
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):  # no autograd through Triton
        return None
    key = (x.shape[0], w.shape[0], w.shape[1], x.dtype, b is not None, x.device)
    if _capturing(x.device):
        cfg = _choice.get(key)
        return None if cfg is None else gemv(x, w, b, cfg)
    if _selecting and key not in _choice:
        try:
            _choice[key] = _stored(key, x, w, b)
            if _choice[key] is _MISSING:
                _choice[key] = select(x, w, b)[0]
                STORE.put(key[:5], x.device, None if _choice[key] is None else dataclasses.asdict(_choice[key]))
        except Exception as e:  # noqa: BLE001 - never fail a forward over a speed choice (the engine's warm-up
            # would read it as its attention kernel failing): the vendor path for this shape
            log.warning("GEMV selection for %s failed (%s: %s); using cuBLAS", key[:4], type(e).__name__, e)
            _choice[key] = None
    return None


STORE = choices.ChoiceStore("gpu_gemv", [Path(__file__)])  # choices timed by earlier processes on this GPU


def _stored(key: tuple, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> Config | None | object:
    """An earlier process's choice for ``key`` if it is still a config of this module and gives F.linear's result
    here (one call, as :func:`select` checks a candidate; only the timing is skipped); else _MISSING."""
    got = STORE.get(key[:5], x.device)
    if got is None or got is choices.MISSING:
        return _MISSING if got is choices.MISSING else None
    try:
        cfg = Config(**got)
    except TypeError:
        return _MISSING
    if cfg not in configs(x.shape[0]):
        return _MISSING
    return cfg if _matches(gemv(x, w, b, cfg), F.linear(x, w, b).float()) else _MISSING


def _matches(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """A candidate's output against F.linear's (float32): within 2% of the largest output (16-bit sums)."""
    return (y.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item() + 1e-3
