"""Post-load fusion of projections that read the same input: one GEMM instead of two or three.

A component that computes several linears of one input declares them through ``fusable_projections()``:
a list of ``(fused_name, [part names], on_fused)``. This pass concatenates the parts' weights (and biases)
row-wise into one new linear, gives the parts views into it (their names and shapes stay valid, no memory is
duplicated) and calls ``on_fused(fused_linear)`` so the component switches to the fused path. Nothing here
knows a model family: attention's q/k/v and a gated MLP's gate/up are just two users.

Only plain float linears are fused; block-quantized (packed) or otherwise special weights stay as they are.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..registry import create


def _plain(lin: Any) -> bool:
    w = getattr(lin, "weight", None)
    return (type(lin).__name__ == "Linear" and getattr(lin, "packed", None) is None and isinstance(w, torch.Tensor)
            and w.is_floating_point() and not w.is_meta and w.dim() == 2)


def fuse_linears(parts: list[Any]) -> nn.Module | None:
    """One linear computing ``cat([p(x) for p in parts], -1)``; None when the parts cannot be fused."""
    if not parts or not all(_plain(p) for p in parts):
        return None
    w0 = parts[0].weight
    if any(p.weight.shape[1] != w0.shape[1] or p.weight.dtype != w0.dtype or p.weight.device != w0.device
           for p in parts):
        return None
    biased = [p.bias is not None for p in parts]
    if any(biased) and not all(biased):
        return None
    rows = [p.weight.shape[0] for p in parts]
    fused = create("linear", {"in_features": w0.shape[1], "out_features": sum(rows), "bias": all(biased)})
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        if all(biased):
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        # the parts keep working (and keep their parameter names) as views into the fused tensors
        for p, w, b in zip(parts, fused.weight.split(rows), fused.bias.split(rows) if all(biased) else [None] * 3):
            p.weight = nn.Parameter(w, requires_grad=False)
            if b is not None:
                p.bias = nn.Parameter(b, requires_grad=False)
    return fused


def fuse_projections(net: nn.Module) -> int:
    """Fuse every component's declared projection groups in ``net``; returns how many groups were fused."""
    done = 0
    for m in list(net.modules()):
        groups = getattr(m, "fusable_projections", None)
        if groups is None:
            continue
        for name, part_names, on_fused in groups():
            fused = fuse_linears([getattr(m, n) for n in part_names])
            if fused is not None:
                m.add_module(name, fused)
                on_fused(fused)
                done += 1
    return done
