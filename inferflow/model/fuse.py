"""Post-load fusion of projections that read the same input: one GEMM instead of two or three.

A component that computes several linears of one input declares them through ``fusable_projections()``:
a list of ``(fused_name, [part names], on_fused)``. This pass concatenates the parts' weights (and biases)
row-wise into one new linear, gives the parts views into it (their names and shapes stay valid, no memory is
duplicated) and calls ``on_fused(fused_linear)`` so the component switches to the fused path. Nothing here
knows a model family: attention's q/k/v and a gated MLP's gate/up are just two users.

Plain float linears are fused, and block-quantized linears held for the GPU's Triton kernels or the CPU's native
block kernels (kinds "triton" / "native", quant/cpu_kernels.py) whose parts share one kind, block type and K:
their raw block rows are concatenated (a block row is a whole output row, so the fused blocks are exactly the fused
weight's blocks) and the parts keep views.
Other packed or special weights stay as they are.
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


def _triton_packed(lin: Any) -> bool:
    packed = getattr(lin, "packed", None)
    blocks = getattr(lin, "weight_blocks", None)
    return (type(lin).__name__ == "Linear" and isinstance(packed, dict) and set(packed) == {"weight"}
            and (getattr(lin, "kernels", None) or {}).get("weight") in ("triton", "native")
            and isinstance(blocks, torch.Tensor)
            and blocks.dim() == 2 and len(packed["weight"][1]) == 2)


def out_rows(lin: Any) -> int:
    """Output features of a linear: its weight's rows, float or held as blocks (0 when it has neither)."""
    packed = getattr(lin, "packed", None)
    if isinstance(packed, dict) and "weight" in packed:
        return int(packed["weight"][1][0])
    return int(getattr(getattr(lin, "weight", None), "shape", (0,))[0])


def _fuse_packed(parts: list[Any]) -> nn.Module | None:
    """The fused linear of Triton-held block-quantized parts (same block type, K, device, bias pattern)."""
    from ..quant.packed import PackedTensor, hold

    (qtype, (_, k)), b0, kind = parts[0].packed["weight"], parts[0].weight_blocks, parts[0].kernels["weight"]
    if any(p.kernels["weight"] != kind or p.packed["weight"][0] != qtype or p.packed["weight"][1][1] != k
           or p.weight_blocks.device != b0.device or p.weight_blocks.shape[1] != b0.shape[1] for p in parts):
        return None
    biased = [p.bias is not None for p in parts]
    if any(biased) and not all(biased):
        return None
    rows = [out_rows(p) for p in parts]
    fused = create("linear", {"in_features": k, "out_features": sum(rows), "bias": all(biased)})
    with torch.no_grad():
        blocks = torch.cat([p.weight_blocks for p in parts])
        hold(fused, "weight", PackedTensor(blocks, qtype, (sum(rows), k)))
        fused.kernels = {"weight": kind}
        if all(biased):
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        # the parts keep working (on the GPU or the reference path) as views into the fused blocks: no copy stays
        for p, blk, b in zip(parts, blocks.split(rows), fused.bias.split(rows) if all(biased) else [None] * len(rows)):
            p.weight_blocks = blk
            if b is not None:
                p.bias = nn.Parameter(b, requires_grad=False)
    return fused


def fuse_linears(parts: list[Any]) -> nn.Module | None:
    """One linear computing ``cat([p(x) for p in parts], -1)``; None when the parts cannot be fused."""
    if parts and all(_triton_packed(p) for p in parts):
        return _fuse_packed(parts)
    if parts and all((getattr(p, "kernels", None) or {}).get("weight") == "int4" for p in parts):
        from ..quant.int4_fuse import fuse_int4  # CPU int4-kernel parts: their packed rows concatenate

        return fuse_int4(parts, lambda k, n, b: create("linear", {"in_features": k, "out_features": n, "bias": b}))
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
