"""One-kernel versions of the small element-wise ops a decode step is made of (CUDA, through Triton).

At decode sizes a layer's RMSNorm, q/k norms, RoPE and SwiGLU product are each 5-8 tiny torch kernels; under a
CUDA graph their launch cost is gone but each still costs a few microseconds of GPU time, which over 36 layers
rivals the weight reads themselves. Each function here is one kernel computing bit-for-bit what the torch
composition computes (same float32 math, same roundings to the activation dtype), so components switch to it
without changing results. Used only for CUDA tensors (or under ``TRITON_INTERPRET=1`` when ``force``d in
tests); set ``INFERFLOW_FUSED_OPS=0`` to turn it off.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

ENABLED = triton is not None and os.environ.get("INFERFLOW_FUSED_OPS", "1") != "0"


def usable(x: torch.Tensor) -> bool:
    """Whether the fused kernel serves this tensor: CUDA (or the interpreter), float dtype, switched on."""
    return ENABLED and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and x.is_floating_point()


if triton is not None:
    @triton.jit
    def rms_apply(x, W, Y, offs, mask, eps, offset, D: tl.constexpr, WEIGHT_IN_FLOAT: tl.constexpr,
                  HAS_OFFSET: tl.constexpr):
        """RMSNorm of one float32 row ``x`` times the weight, with the torch composition's roundings, in Y's dtype."""
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
        hn = x * rstd
        w = tl.load(W + offs, mask=mask, other=0.0)
        if HAS_OFFSET:
            wf = w.to(tl.float32) + offset
        else:
            wf = w.to(tl.float32)
        if WEIGHT_IN_FLOAT:
            y = hn * wf
        else:  # torch: w.to(dtype) * h.to(dtype), a product of two rounded values
            if HAS_OFFSET:
                wf = wf.to(Y.dtype.element_ty).to(tl.float32)
            y = wf * hn.to(Y.dtype.element_ty).to(tl.float32)
        return y.to(Y.dtype.element_ty)

    @triton.jit
    def _rmsnorm(X, W, Y, sx_n, sx_h, H, eps, offset, D: tl.constexpr, BLOCK: tl.constexpr,
                 WEIGHT_IN_FLOAT: tl.constexpr, HAS_OFFSET: tl.constexpr):
        row = tl.program_id(0)
        n = row // H
        h = row % H
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        x = tl.load(X + n * sx_n + h * sx_h + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * D + offs, rms_apply(x, W, Y, offs, mask, eps, offset, D, WEIGHT_IN_FLOAT, HAS_OFFSET),
                 mask=mask)

    @triton.jit
    def _silu_mul(G, Y, O, sg, sy, I, BLOCK: tl.constexpr):
        n = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        g = tl.load(G + n * sg + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(Y + n * sy + offs, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(O.dtype.element_ty).to(tl.float32)
        tl.store(O + n * I + offs, (s * u).to(O.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_half(X, C, S, O, sx_n, sx_h, sc_n, H, HALF: tl.constexpr):
        row = tl.program_id(0)
        n = row // H
        h = row % H
        i = tl.arange(0, HALF)
        base = X + n * sx_n + h * sx_h
        x1 = tl.load(base + i).to(tl.float32)
        x2 = tl.load(base + HALF + i).to(tl.float32)
        c1 = tl.load(C + n * sc_n + i).to(tl.float32)
        c2 = tl.load(C + n * sc_n + HALF + i).to(tl.float32)
        s1 = tl.load(S + n * sc_n + i).to(tl.float32)
        s2 = tl.load(S + n * sc_n + HALF + i).to(tl.float32)
        dt = O.dtype.element_ty
        # torch: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype
        o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        out = O + row * 2 * HALF
        tl.store(out + i, o1)
        tl.store(out + HALF + i, o2)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
            weight_in_float: bool = False) -> torch.Tensor | None:
    """RMSNorm over the last dim of [N, D] or [N, H, D] (last dim contiguous), contiguous out; None: not served."""
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or weight.dim() != 1:
        return None
    D = x.shape[-1]
    N, H = x.shape[0], (x.shape[1] if x.dim() == 3 else 1)
    sh = x.stride(1) if x.dim() == 3 else 0
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if N * H:
        _rmsnorm[(N * H,)](x, weight, y, x.stride(0), sh, H, float(eps), float(offset), D=D,
                           BLOCK=triton.next_power_of_2(D), WEIGHT_IN_FLOAT=weight_in_float,
                           HAS_OFFSET=bool(offset), num_warps=4 if D <= 4096 else 8)
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [N, I] views with contiguous rows (e.g. the two halves of a fused gate/up output)."""
    N, I = gate.shape
    out = torch.empty((N, I), dtype=gate.dtype, device=gate.device)
    BLOCK = 1024
    if N:
        _silu_mul[(N, triton.cdiv(I, BLOCK))](gate, up, out, gate.stride(0), up.stride(0), I, BLOCK=BLOCK)
    return out


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """Full rotate-half RoPE of x [N, H, D] (last dim contiguous, D/2 a power of two) with cos/sin [N, 1, D]
    in x's dtype; None: not served (partial rotary, odd sizes)."""
    N, H, D = x.shape
    half = D // 2
    if (x.stride(-1) != 1 or cos.shape[-1] != D or half & (half - 1) or cos.stride(-1) != 1
            or cos.stride(0) != sin.stride(0) or sin.stride(-1) != 1 or cos.dtype != x.dtype):
        return None
    out = torch.empty((N, H, D), dtype=x.dtype, device=x.device)
    if N * H:
        _rope_half[(N * H,)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), H, HALF=half)
    return out
