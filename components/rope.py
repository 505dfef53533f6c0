"""Rotary position embeddings: rotate-half (HF/NeoX) or interleaved pairs (GPT-J, Meta), partial
rotary, any theta, and the linear, dynamic-NTK, llama3 and yarn frequency scalings."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from inferflow.component import Component
from inferflow.registry import register


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, s: dict, max_pos: int | None) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    orig = s.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def get_mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn = get_mscale(factor, s["mscale"]) / get_mscale(factor, s["mscale_all_dim"])
        else:
            attn = get_mscale(factor)

    def corr(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    low, high = corr(beta_fast), corr(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrap = 1 - ramp
    inter = inv_freq / factor
    return inter * (1 - extrap) + inv_freq * extrap, attn


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old = s["original_max_position_embeddings"]
    low_wl, high_wl = old / lo, old / hi
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return torch.where(medium, smoothed, out)


# llama.cpp's GGUF names ({arch}.rope.scaling.*) for the HF rope_scaling keys they carry
_GGUF_SCALING_KEYS = {"original_context_length": "original_max_position_embeddings", "yarn_beta_fast": "beta_fast",
                      "yarn_beta_slow": "beta_slow", "yarn_attn_factor": "attention_factor"}


@register("rope")
class RoPE(Component):
    # Per-pair frequency divisors (llama.cpp's rope_freqs tensor, how GGUF files carry llama3 scaling): used when
    # the file has them, else absent. Kept in float32 like inv_freq.
    optional_weights = ("freq_factors",)

    @dataclass(slots=True)
    class Params:
        dim: int                          # rotated dimensions per head (partial rotary: < head_dim)
        theta: float = 10000.0
        style: str = "half"               # "half" (rotate-half) or "interleaved" (pairs 2i, 2i+1)
        scaling: dict | None = None       # HF rope_scaling / rope_parameters, or GGUF's rope.scaling.* keys
        max_position_embeddings: int | None = None

    def __init__(self, p: Params):
        super().__init__()
        if p.style not in ("half", "interleaved"):
            raise ValueError(f"rope style must be 'half' or 'interleaved', got {p.style!r}")
        self.dim, self.theta, self.style, self.max_pos = p.dim, p.theta, p.style, p.max_position_embeddings
        s = dict(p.scaling or {})
        s.update({hf: s[k] for k, hf in _GGUF_SCALING_KEYS.items() if k in s and hf not in s})
        self.kind = s.get("rope_type") or s.get("type") or "default"
        if self.kind == "none":  # GGUF's name for no scaling
            self.kind = "default"
        self.factor = float(s.get("factor") or 1.0)
        self.mscale = 1.0
        inv = 1.0 / (p.theta ** (torch.arange(0, p.dim, 2, dtype=torch.int64).float() / p.dim))
        if self.kind == "linear":
            inv = inv / self.factor
        elif self.kind == "llama3":
            inv = _llama3(inv, s)
        elif self.kind == "yarn":
            inv, self.mscale = _yarn(inv, p.dim, p.theta, s, p.max_position_embeddings)
        elif self.kind not in ("default", "dynamic"):
            raise ValueError(f"unsupported rope scaling type {self.kind!r} (default, linear, dynamic, llama3, yarn)")
        self.inv_freq = inv  # kept in float32 off the module's buffers so dtype casts never touch it
        self.declare("freq_factors", (p.dim // 2,))

    def _inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        inv = self.inv_freq
        if self.kind == "dynamic" and self.max_pos:
            seq = int(positions.max()) + 1
            if seq > self.max_pos:
                base = self.theta * ((self.factor * seq / self.max_pos) - (self.factor - 1)) ** (self.dim / (self.dim - 2))
                inv = 1.0 / (base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim))
        if inv is self.inv_freq:  # keep the device copy: a host->device copy per forward cannot be graph-captured
            src, dev = getattr(self, "_inv_dev", (None, None))
            if src is not inv or dev.device != positions.device:
                src, dev = self._inv_dev = (inv, inv.to(positions.device))
            inv = dev
        else:
            inv = inv.to(positions.device)
        factors = self._parameters.get("freq_factors")
        if factors is not None and not factors.is_meta:  # llama.cpp: theta_i = pos * inv_freq_i / factor_i
            inv = inv / factors.to(device=positions.device, dtype=torch.float32)
        return inv

    def cos_sin(self, ctx, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("rope", id(self), dtype)
        hit = ctx.memo.get(key)
        if hit is None:
            freqs = ctx.positions.float()[:, None] * self._inv_freq(ctx.positions)[None, :]
            cos, sin = freqs.cos() * self.mscale, freqs.sin() * self.mscale
            if self.style == "half":
                cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
            else:
                cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
            hit = ctx.memo[key] = (cos[:, None, :].to(dtype), sin[:, None, :].to(dtype))
        return hit

    def _table(self, ctx, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[-sin | sin]`` of this forward's positions, rows of a per-module table.

        The table (every position below a power of two, grown on demand) is computed once instead of cos/sin
        per forward; its rows equal the per-forward values bit for bit (the same float32 products and kernels).
        """
        key = ("rope_table", id(self), dtype)
        hit = ctx.memo.get(key)
        if hit is None:
            pos = ctx.positions
            need = int(pos.max()) + 1 if pos.numel() else 1
            tab = getattr(self, "_tab", None)
            if tab is None or tab[0] < need or tab[1] != dtype:
                size = 1 << max(need - 1, 255).bit_length()
                freqs = torch.arange(size, dtype=torch.float32)[:, None] * self._inv_freq(pos)[None, :]
                cos, sin = freqs.cos() * self.mscale, freqs.sin() * self.mscale
                tab = (size, dtype, torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype))
                self._tab = tab
            hit = ctx.memo[key] = (tab[2].index_select(0, pos)[:, None, :], tab[3].index_select(0, pos)[:, None, :])
        return hit

    def _rot_table(self, x: torch.Tensor, cos: torch.Tensor, ssin: torch.Tensor) -> torch.Tensor:
        # x*cos + rotate_half(x)*sin with rotate_half(x)*sin == roll(x, d/2) * [-sin | sin]: 4 ops instead of 7+
        rolled = torch.roll(x, self.dim // 2, -1)
        return torch.mul(x, cos).add_(rolled.mul_(ssin))

    def _rot(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :self.dim], x[..., self.dim:]
        if self.style == "half":
            h = self.dim // 2
            rotated = torch.cat([-rot[..., h:], rot[..., :h]], dim=-1)
        else:
            pairs = rot.unflatten(-1, (-1, 2))
            rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
        out = rot * cos + rotated * sin
        return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out

    def _tabled(self, x: torch.Tensor, ctx) -> bool:
        return (x.device.type == "cpu" and self.style == "half" and self.dim == x.shape[-1] and self.kind != "dynamic"
                and ctx.positions.device.type == "cpu")

    def rotate_heads(self, x: torch.Tensor, ctx) -> torch.Tensor | None:
        """q and k heads side by side [N, H + Hkv, D] rotated in one pass (the same values as ``rotate``); None
        where only ``rotate`` applies."""
        if not self._tabled(x, ctx):
            return None
        cos, ssin = self._table(ctx, x.dtype)
        return self._rot_table(x, cos, ssin)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tabled(q, ctx) and self.dim == k.shape[-1]:
            # CPU: cos/sin rows of a table (no cos/sin per forward) and a rotation of fewer ops; same bits
            cos, ssin = self._table(ctx, q.dtype)
            return self._rot_table(q, cos, ssin), self._rot_table(k, cos, ssin)
        cos, sin = self.cos_sin(ctx, q.dtype)
        if q.is_cuda and self.style == "half" and self.dim == q.shape[-1] == k.shape[-1]:
            from inferflow.model import fused_ops  # one kernel each, the same roundings

            if fused_ops.ENABLED:
                rq, rk = fused_ops.rope_half(q, cos, sin), fused_ops.rope_half(k, cos, sin)
                if rq is not None and rk is not None:
                    return rq, rk
        return self._rot(q, cos, sin), self._rot(k, cos, sin)

    def forward(self, x, ctx=None):  # pragma: no cover - used through rotate()
        return x
