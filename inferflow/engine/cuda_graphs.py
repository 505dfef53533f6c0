"""CUDA graphs for decode steps: one captured static decode step (static_decode.py) per batch-size bucket.

A pure-decode batch of ``n`` sequences replays the graph of the smallest bucket >= n (1, 2, 4, 8, 16, 32, 40, 48,
..., up to ``max_num_seqs``: :func:`buckets`), so a step costs one graph launch instead of a few thousand kernel launches from
Python. Each bucket is captured after a warm-up run on a side stream (Triton compiles, the GEMV choices are
timed, the allocator settles), all in one shared memory pool: every bucket when the engine starts
(``capture_all``, largest first, as vLLM does; ``EngineConfig.capture_graphs_at_start``), else a bucket on its
first use, which then stalls that serving step for the capture. Steps with prefill chunks stay eager
(model_runner.py), but for short ones where ``EngineConfig.graph_prefill_tokens`` asks: those replay a graph of
their own per bucket (``chained``, captured after the decode buckets), each new token a decode row.
A bucket whose capture fails (an op that syncs with the host, say) turns graphs off for the engine: the
static step then runs eagerly, which is still correct.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import time
from typing import Any, Sequence

import torch

from .static_decode import StaticDecode


def _gemv_selection() -> contextlib.AbstractContextManager:
    """The Triton GEMV's per-shape timing window (model/gpu_gemv.py), or nothing where triton is not installed."""
    try:
        from ..model.gpu_gemv import selecting
    except ImportError:
        return contextlib.nullcontext()
    return selecting()


log = logging.getLogger(__name__)


def buckets(max_batch: int, sizes: Sequence[int] | None = None) -> list[int]:
    """The graphs' row counts up to ``max_batch``, which closes the list: ``sizes`` below it, else powers of two
    up to 32, then steps of a quarter of the power of two below (8 up to 64, 16 up to 128, 32 up to 256, ...).
    A batch pads to the next bucket: at most a quarter of its rows from 32 on, where powers of two alone padded
    up to all (65 sequences ran 128 rows), as vLLM's capture sizes (steps of 8) avoid too."""
    if sizes is not None:
        return sorted({int(v) for v in sizes if v < max_batch}) + [max_batch]
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b = b * 2 if b < 32 else b + (1 << (b.bit_length() - 3))
    return out + [max_batch]


class _Scratch:
    """A stand-in sequence for captures at start: the block table of one scratch block."""

    __slots__ = ("block_table",)

    def __init__(self, blocks: list[int]):
        self.block_table = blocks


class DecodeGraphs:
    """Replays captured static decode steps; ``graphs=False`` runs the same padded step eagerly (CPU tests)."""

    def __init__(self, model: Any, cache: Any, max_batch: int, max_model_len: int, *, graphs: bool = True,
                 use_kernel: bool | None = None, chained_rows: int = 0, sizes: Sequence[int] | None = None):
        """``max_batch`` decode rows; ``chained_rows``: up to this many token rows of steps with prefill chunks;
        ``sizes``: the buckets (see :func:`buckets`)."""
        self.static = StaticDecode(model, cache, max(max_batch, chained_rows), max_model_len, use_kernel)
        self.buckets = buckets(max(max_batch, chained_rows), sizes)
        self.decode_buckets = self.buckets[:self.buckets.index(self.bucket(max_batch)) + 1]  # capture_all's
        self.chained_rows = chained_rows
        self.graphs_on = graphs and model.device.type == "cuda"
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._chained: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # bucket -> chained graph
        self._pool = None
        self.replays = 0
        self.capture_ms: dict[int, float] = {}  # bucket -> ms its warm-up and capture took (capture_all)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def fits(self, n: int, longest: int) -> bool:
        return self.static.fits(n, longest)

    def fits_chained(self, n: int, longest: int) -> bool:
        """Whether ``n`` token rows of a step with prefill chunks (positions below ``longest``) run here."""
        return n <= self.chained_rows and self.static.fits(n, longest)

    @torch.inference_mode()
    def run(self, items: Sequence[tuple[Any, int, int]],
            feed: tuple[torch.Tensor, Sequence[int]] | None = None, chained: bool = False) -> torch.Tensor:
        """float32 logits [n, vocab] for ``(sequence, position, token)`` decode items (``feed``: the token ids
        are gathered on the device, see StaticDecode.prepare; ``chained``: items may be tokens of one sequence,
        see StaticDecodeBackend). Nothing here waits for the device."""
        n = len(items)
        rows = self.bucket(n)
        self.static.prepare(items, rows, feed)
        if not self.graphs_on:
            return self._eager(rows, chained)[:n]
        hit = (self._chained if chained else self._graphs).get(rows)
        if hit is None:
            hit = self._capture(rows, chained)
            if hit is None:
                return self._eager(rows, chained)[:n]
        hit[0].replay()
        self.replays += 1
        return hit[1][:n]

    def capture_all(self, pool: Any) -> int:
        """Capture every bucket's graph now, largest first (the shared memory pool is sized by the largest; the
        others reuse it), then the chained buckets' (``chained_rows``), on one scratch block taken from ``pool``
        and given back: each warm-up and capture runs a one-token sequence at position 0, padded to the bucket.
        -> the graphs captured (0 without graphs)."""
        if not self.graphs_on:
            return 0
        scratch = _Scratch(pool.allocate(1))
        t0 = time.perf_counter()
        todo = [(rows, False) for rows in reversed(self.decode_buckets)]
        if self.chained_rows:
            todo += [(rows, True) for rows in reversed(self.buckets) if rows <= self.bucket(self.chained_rows)]
        try:
            for rows, chained in todo:
                if rows in (self._chained if chained else self._graphs):
                    continue
                t = time.perf_counter()
                try:
                    self.static.prepare([(scratch, 0, 0)], rows)
                    captured = self._capture(rows, chained) is not None
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - out of memory, say: the engine still starts
                    log.warning("capturing the decode graph of %d rows at start failed (%s: %s); the buckets left are "
                                "captured on first use", rows, type(e).__name__, e)
                    break
                if not captured:  # graphs are off for the engine now
                    break
                if not chained:
                    self.capture_ms[rows] = (time.perf_counter() - t) * 1000
                log.debug("%s graph of %d rows: %.0f ms", "chained" if chained else "decode", rows,
                          (time.perf_counter() - t) * 1000)
        finally:
            with contextlib.suppress(Exception):  # the scratch block's last writes are done before it is handed out
                torch.cuda.synchronize()
            pool.release(scratch.block_table)
        n = len(self._graphs) + len(self._chained)
        log.info("captured %d decode graphs (%d chained) in %.1f s", n, len(self._chained), time.perf_counter() - t0)
        return n

    def _eager(self, rows: int, chained: bool = False) -> torch.Tensor:
        """The static step without a graph; a failing Triton kernel (a compiler or driver problem) gives way to
        the torch attention path for good (the step only rewrites K/V, so running it again is safe)."""
        try:
            return self.static.forward(rows, chained)
        except Exception as e:  # noqa: BLE001
            if not self.static.use_kernel:
                raise
            log.warning("paged decode kernel failed (%s: %s); using torch attention", type(e).__name__, e)
            self.static.use_kernel = False
            self._graphs.clear()
            self._chained.clear()
            return self.static.forward(rows, chained)

    def _capture(self, rows: int, chained: bool = False) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), _gemv_selection():  # warm-up: compiles kernels, times the GEMV choices for
            for _ in range(2):  # this bucket (model/gpu_gemv.py); rewrites the same K/V the replay writes
                self._eager(rows, chained)
        torch.cuda.current_stream().wait_stream(side)
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):
                out = self.static.forward(rows, chained)
        except Exception as e:  # noqa: BLE001 - an uncapturable op: run eagerly from now on
            log.warning("CUDA graph capture of the decode step failed (%s: %s); decode runs eagerly",
                        type(e).__name__, e)
            self.graphs_on = False
            torch.cuda.synchronize()
            return None
        (self._chained if chained else self._graphs)[rows] = (g, out)
        # the long-lived objects made so far (model, cache, graphs) leave the collector's view, as vLLM does after
        # capture: a full collection walking them (~90 ms here) would otherwise stall a decode step now and then
        gc.collect()
        gc.freeze()
        return g, out
