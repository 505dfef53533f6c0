"""Per-block scale search: pick each block's stored scale (and offset) by trying a few candidates and keeping the
one whose *stored* (header-rounded) parameters give the least squared error, as llama.cpp's make_qkx2_quants and
make_qx_quants do. Everything is vectorised over blocks: the Python loops run over the candidates only.

Two searches:

- :func:`affine`: ``w = offset + scale * q``, q in 0..nmax (asymmetric min + scale). Candidates: the plain
  min/max grid, then for several inverse scales ``(nmax + delta) / (max - min)`` the codes they give and the
  least-squares (scale, offset) for those codes; each candidate is rounded to the header first, and its codes
  recomputed with the rounded values, so the error compared is the error the block will really have.
- :func:`signed`: ``w = scale * level[q]`` for a fixed grid of levels (uniform integers or a codebook) with a
  signed scale: the block's extreme is mapped to either end of the grid, shrunk by clip factors, then refitted by
  least squares for the codes it gives.

Both searches minimise an *importance-weighted* squared error, sum_i w_i (y_i - x_i)^2 with w_i = rms(block) + |x_i|
by default (:func:`importance`; the weighting llama.cpp's k-quants use without an imatrix). Plain squared error lets
a search clip a block's few largest weights to shave error off the many small ones, but those outliers carry
most of a layer's output: weighting by magnitude keeps them near exact (perplexity of the default model at q4
dropped below llama.cpp's q4_0 with it, docs/quantization.md). The least-squares refits are weighted the same way.
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

Params = tuple[torch.Tensor, ...]


class AffineHeader(Protocol):
    def fit(self, scale: torch.Tensor, offset: torch.Tensor) -> Params: ...
    def affine(self, p: Params) -> tuple[torch.Tensor, torch.Tensor]: ...


class SignedHeader(Protocol):
    def fit(self, scale: torch.Tensor) -> Params: ...
    def scale(self, p: Params) -> torch.Tensor: ...


def _safe(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s != 0, s, torch.ones_like(s))


def affine_codes(x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, nmax: int) -> torch.Tensor:
    """Nearest codes 0..nmax of x [n, g] on the grid offset + scale * q (float32)."""
    return ((x - offset) / _safe(scale)).round_().clamp_(0, nmax)


def _pick(better: torch.Tensor, new: Params, old: Params | None) -> Params:
    return new if old is None else tuple(torch.where(better, a, b) for a, b in zip(new, old))


IMPORTANCE = ("rms+abs", "square", "abs", "uniform")
DEFAULT_IMPORTANCE = "uniform"  # measured: no weighting gained (docs/quantization.md); kept selectable


def importance(x: torch.Tensor, kind: str | None = None) -> torch.Tensor:
    """Per-weight error weights for blocks x [n, g]: ``rms+abs`` (rms of the block + |x|), ``square`` (x^2, with a
    floor so zeros still count), ``abs`` (|x|) or ``uniform`` (plain squared error)."""
    kind = kind or DEFAULT_IMPORTANCE
    if kind == "uniform":
        return torch.ones_like(x)
    a = x.abs()
    if kind == "abs":
        return a + 1e-12
    rms2 = x.square().mean(1, keepdim=True)
    if kind == "square":
        return a.square_().add_(rms2 * 1e-3 + 1e-30)
    if kind == "rms+abs":
        return a.add_(rms2.sqrt_())
    raise ValueError(f"unknown importance {kind!r} (one of {IMPORTANCE})")


def _wls(x: torch.Tensor, q: torch.Tensor, w: torch.Tensor, sw: torch.Tensor,
         swx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted least-squares (scale, offset) of x ~ offset + scale * q per block; ok where it is well posed."""
    wq = w * q
    swq, swqq, swqx = wq.sum(1, keepdim=True), (wq * q).sum(1, keepdim=True), (wq * x).sum(1, keepdim=True)
    det = sw * swqq - swq * swq
    s = (sw * swqx - swq * swx) / _safe(det)
    ok = (det > 0) & (s > 0)
    return s, (swx - s * swq) / _safe(sw), ok


def affine(x: torch.Tensor, nmax: int, header: AffineHeader, deltas: Sequence[float],
           weight: str | None = None, refine: int = 2) -> Params:
    """Best header parameters per block of x [n, g] (float32) for an asymmetric grid of nmax + 1 levels
    (the header's zero-point range must include 0..nmax), by importance-weighted squared error; ``refine``
    rounds of refitting the winner to its own codes follow the candidates."""
    w = importance(x, weight)
    sw, swx = w.sum(1, keepdim=True), (w * x).sum(1, keepdim=True)
    mn, mx = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    rng = mx - mn
    # a constant block (rng 0) still needs a grid that reaches its value: span [min(c, 0), max(c, 0)]
    flat = rng <= 0
    span = torch.where(flat, torch.maximum(mx.abs(), mn.abs()), rng)
    base = torch.where(flat, torch.minimum(mn, torch.zeros_like(mn)), mn)
    # the grid through zero, [min(min, 0), max(max, 0)]: its zero point is always storable, so blocks far from
    # zero (all one sign) still get a usable grid when their own zero point is out of the header's range
    lo0, hi0 = torch.minimum(mn, torch.zeros_like(mn)), torch.maximum(mx, torch.zeros_like(mx))
    best_err, best = None, None

    def consider(s: torch.Tensor, m: torch.Tensor) -> None:
        nonlocal best_err, best
        p = header.fit(s, m)
        scale, offset = header.affine(p)
        y = affine_codes(x, scale, offset, nmax).mul_(scale).add_(offset)
        err = (y.sub_(x)).square_().mul_(w).sum(1, keepdim=True)
        better = err < best_err if best_err is not None else torch.ones_like(err, dtype=torch.bool)
        best = _pick(better, p, best)
        best_err = err if best_err is None else torch.where(better, err, best_err)

    for delta in ("zero", None, *deltas):
        if delta == "zero":
            consider((hi0 - lo0) / nmax, lo0)
        elif delta is None:
            consider(span / nmax, base)
        else:
            q = ((x - mn) * ((nmax + delta) / _safe(rng))).round_().clamp_(0, nmax)
            s, m, ok = _wls(x, q, w, sw, swx)
            consider(torch.where(ok, s, span / nmax), torch.where(ok, m, base))
    for _ in range(refine):  # the winner's own (rounded-header) codes, refitted: a fixed-point step
        scale, offset = header.affine(best)
        s, m, ok = _wls(x, affine_codes(x, scale, offset, nmax), w, sw, swx)
        consider(torch.where(ok, s, scale), torch.where(ok, m, offset))
    return best


class Grid(Protocol):
    lo: float   # the grid's lowest and highest level values
    hi: float
    def codes(self, u: torch.Tensor) -> torch.Tensor: ...
    def values(self, q: torch.Tensor) -> torch.Tensor: ...
    def nearest(self, u: torch.Tensor) -> torch.Tensor: ...  # the nearest level's value (may be approximate)


class UniformGrid:
    """Integer levels lo..hi (codes are the levels themselves)."""

    def __init__(self, lo: int, hi: int):
        self.lo, self.hi = float(lo), float(hi)

    def codes(self, u: torch.Tensor) -> torch.Tensor:
        return u.round().clamp_(self.lo, self.hi)

    def values(self, q: torch.Tensor) -> torch.Tensor:
        return q

    def nearest(self, u: torch.Tensor) -> torch.Tensor:
        return self.codes(u)


class Codebook:
    """Sorted float32 levels; codes are indices (nearest level)."""

    def __init__(self, levels: torch.Tensor):
        self.levels = levels
        self.mids = (levels[1:] + levels[:-1]) / 2
        self.lo, self.hi = float(levels[0]), float(levels[-1])

    def codes(self, u: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(u, self.mids.to(u.device))

    def values(self, q: torch.Tensor) -> torch.Tensor:
        return self.levels.to(q.device)[q]

    def nearest(self, u: torch.Tensor) -> torch.Tensor:
        """The nearest level's value as a sum of steps, each a clamped ramp 1e6 wide around its midpoint: exact
        except within ~1e-6 of a midpoint, and 5-6x faster than bucketize + gather (comparisons and gathers are
        slow torch CPU kernels). The search only compares errors with it; final codes use :meth:`codes`."""
        v = torch.full_like(u, self.lo)
        lv = self.levels.tolist()
        for k, m in enumerate(self.mids.tolist()):
            v.add_((u - m).mul_(1e6).clamp_(0, 1), alpha=lv[k + 1] - lv[k])
        return v


def signed(x: torch.Tensor, grid: Grid, header: SignedHeader, factors: Sequence[float],
           both_ends: bool = True, refits: Sequence[bool] = (False, True), weight: str | None = None) -> Params:
    """Best signed-scale header per block of x [n, g] for ``w = scale * grid.values(q)`` by importance-weighted
    squared error; ``refits``: try each clipped scale as is (False) and/or least-squares refitted to the codes it
    gives (True)."""
    wt = importance(x, weight)
    wx = wt * x
    ext = x.gather(1, x.abs().argmax(1, keepdim=True))  # the signed extreme
    best_err, best = None, None
    ends = (grid.lo, grid.hi) if both_ends else (grid.lo,)
    for f in factors:
        for end in ends:
            s0 = ext * (f / end)
            for refit in refits:
                s = s0
                if refit:
                    c = grid.nearest(x / _safe(s0))
                    s = (c * wx).sum(1, keepdim=True) / (c * c * wt).sum(1, keepdim=True).clamp_min(1e-30)
                p = header.fit(s)
                scale = header.scale(p)
                y = grid.nearest(x / _safe(scale)).mul_(scale)
                err = (y - x).square_().mul_(wt).sum(1, keepdim=True)
                better = err < best_err if best_err is not None else torch.ones_like(err, dtype=torch.bool)
                best = _pick(better, p, best)
                best_err = err if best_err is None else torch.where(better, err, best_err)
    return best


def chunked(fn: Callable[[torch.Tensor], torch.Tensor], blocks: torch.Tensor, out_cols: int,
            out_dtype: torch.dtype, chunk_elems: int = 1 << 18) -> torch.Tensor:
    """``fn`` over row chunks of blocks [n, g] (bounded temporaries, cache-sized working sets)."""
    n, g = blocks.shape
    step = max(1, chunk_elems // max(g, 1))
    if n <= step:
        return fn(blocks)
    out = torch.empty(n, out_cols, dtype=out_dtype, device=blocks.device)
    for r in range(0, n, step):
        out[r:r + step] = fn(blocks[r:r + step])
    return out
