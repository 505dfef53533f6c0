"""Residual add + the RMSNorm of that sum as one kernel (CUDA, through Triton).

Pre-norm layers end each half with ``s = x + branch`` immediately followed by ``rmsnorm(s)`` (the attention add
then the post-attention norm; the MLP add then the next layer's input norm, across flows). The sum is still
needed (it is the next residual), so one kernel writes both ``s`` and ``rmsnorm(s)``: one launch and one read of
``s`` instead of two kernels.

``fuse_add_norms(net)`` finds the pattern in the assembled flows (any spec, nothing family-specific): an ``add``
step whose output is consumed by the next step, an ``rmsnorm`` (in the same flow, or the first step of the next
flow of the stack when the add is a flow's last step). It links the two modules; at run time the add computes
both outputs and hands the normalized one to the norm, which takes it only if its input *is* that sum tensor,
so a pairing that does not hold at run time just runs the torch path. Same float32 math and
roundings as the torch composition (the sum rounded to the dtype first, as ``a + b`` does).

Off with ``INFERFLOW_FUSE_ADD_NORM=0`` or ``EngineConfig(fuse_add_norm=False)``; a kernel failure warns once and
falls back to the torch path for good.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
if triton is not None:
    from .fused_ops import rms_apply  # the norm's arithmetic, shared with the plain fused RMSNorm

ENV = "INFERFLOW_FUSE_ADD_NORM"
_state = {"ok": triton is not None}


def enabled() -> bool:
    """Whether the pass may be applied: Triton importable, not switched off by $INFERFLOW_FUSE_ADD_NORM=0."""
    return _state["ok"] and os.environ.get(ENV, "1") != "0"


if triton is not None:
    @triton.jit
    def _add_rmsnorm(A, B, W, S, Y, sa, sb, eps, offset, D: tl.constexpr, BLOCK: tl.constexpr,
                     WEIGHT_IN_FLOAT: tl.constexpr, HAS_OFFSET: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        a = tl.load(A + row * sa + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + row * sb + offs, mask=mask, other=0.0).to(tl.float32)
        s = (a + b).to(S.dtype.element_ty)  # torch: a + b computed in float32, rounded to the dtype
        tl.store(S + row * D + offs, s, mask=mask)
        tl.store(Y + row * D + offs, rms_apply(s.to(tl.float32), W, Y, offs, mask, eps, offset, D, WEIGHT_IN_FLOAT,
                                               HAS_OFFSET), mask=mask)


def _served(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def add_rmsnorm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                weight_in_float: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(a + b, rmsnorm(a + b))`` in one kernel for same-shape, same-dtype float tensors with contiguous rows
    (last dim normalized); None: not served (the caller runs the torch path)."""
    if a.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # CPU: one native call, bit for bit the torch ops (inferflow/native/cpu_ops.py); $INFERFLOW_FUSE_ADD_NORM
        # was honoured when the links were made (fuse_add_norms)
        from ..native import cpu_ops

        return cpu_ops.add_rmsnorm(a, b, weight, eps, offset, weight_in_float)
    if (not enabled() or a.shape != b.shape or a.dtype != b.dtype or not a.is_floating_point() or a.dim() < 1
            or a.device != b.device or weight.device != a.device or not _served(a) or weight.dim() != 1
            or weight.shape[0] != a.shape[-1] or weight.dtype != a.dtype  # torch rounds w to the dtype first
            or not (a.is_contiguous() and b.is_contiguous())):
        return None
    D = a.shape[-1]
    s = torch.empty_like(a)
    y = torch.empty_like(a)
    rows = a.numel() // D if D else 0
    if rows:
        try:
            _add_rmsnorm[(rows,)](a, b, weight, s, y, D, D, float(eps), float(offset), D=D,
                                  BLOCK=triton.next_power_of_2(D), WEIGHT_IN_FLOAT=bool(weight_in_float),
                                  HAS_OFFSET=bool(offset), num_warps=4 if D <= 4096 else 8)
        except Exception as e:  # noqa: BLE001 - any compile/launch failure: torch path from now on
            _state["ok"] = False
            warnings.warn(f"fused add+rmsnorm kernel failed ({type(e).__name__}: {e}); using the torch path "
                          f"(set {ENV}=0 to skip it)", RuntimeWarning, stacklevel=2)
            return None
    return s, y


def _consumes_previous(inputs: tuple[str, ...] | None, prev: str) -> bool:
    return inputs is None or inputs == (prev,)


def _link(add: nn.Module, norm: nn.Module) -> bool:
    if getattr(add, "component_name", None) != "add" or getattr(norm, "component_name", None) != "rmsnorm":
        return False
    # a tuple, not an attribute holding the module: the norm must not become the add's child (parameter names)
    add.fused_norm = (norm,)
    return True


def fuse_add_norms(net: nn.Module) -> int:
    """Link every residual ``add`` to the RMSNorm that consumes its sum next (within a flow, and a flow's last
    add to the next flow's first norm in a stack); returns the number of links made."""
    from .flow import Flow, Stack

    if not enabled():
        return 0
    done = 0
    for stack in [m for m in net.modules() if isinstance(m, Stack)]:
        chain = [f for f in [stack.embed, *stack.layers, stack.final] if f is not None]
        for f, nxt in zip(chain, chain[1:]):
            last, _ = f.plan[-1]
            first, inputs = nxt.plan[0]
            if nxt.first_input == "x" and inputs in (None, ("x",)):  # the layer's input is the previous output
                done += _link(f._modules[last], nxt._modules[first])
    for f in [m for m in net.modules() if isinstance(m, Flow)]:
        for (prev, _), (name, inputs) in zip(f.plan, f.plan[1:]):
            if _consumes_previous(inputs, prev):
                done += _link(f._modules[prev], f._modules[name])
    return done


def take(norm: nn.Module, x: Any) -> torch.Tensor | None:
    """The normalized output the linked add computed for ``x``, if ``x`` is that sum; else None. (The flow step
    between them is the norm itself: nothing can have modified the sum in place meanwhile.)"""
    pending = norm.__dict__.pop("fused_pending", None)
    if pending is not None and pending[0] is x:
        return pending[1]
    return None


def run_add(add: nn.Module, xs: Any) -> torch.Tensor | None:
    """The linked add's sum (its norm's output stashed for it), or None when the fused kernel does not serve."""
    norm = add.fused_norm[0]
    if not isinstance(xs, (list, tuple)) or len(xs) != 2:
        return None
    out = add_rmsnorm(xs[0], xs[1], norm.weight, norm.eps, norm.offset, norm.weight_in_float)
    if out is None:
        return None
    s, y = out
    norm.__dict__["fused_pending"] = (s, y)
    return s
