"""q/k/v or gate/up linears held for torch's CPU int4 kernel (quant/cpu_kernels.py) fused into one linear: the
post-load pass in inferflow/model/fuse.py calls :func:`fuse_int4` when every part runs that kernel."""
from __future__ import annotations

from typing import Callable

import torch


def fuse_int4(parts: list[torch.nn.Module], make: Callable[[int, int, bool], torch.nn.Module]
              ) -> torch.nn.Module | None:
    """One int4-held linear computing ``cat([p(x) for p in parts], -1)`` (q/k/v, gate/up: model/fuse.py), or None.

    The kernel packs whole row blocks independently, so the parts' packed rows concatenate into the packing of
    the stacked weight (every part but the last a multiple of 64 rows: the row block of every layout) and their
    (scale, zero) tables concatenate along N. One call instead of two or three saves per call a kernel launch
    and both activation casts (q4_0 class file, generate_ids at 1 thread: decode x1.09; the same logits bit for
    bit). ``make(in_features, out_features, bias)`` builds the empty linear. The parts
    keep working as views into the fused codes (their own small scale tables stay)."""
    held = [(getattr(p, "kernels", None) or {}).get("weight") == "int4"
            and isinstance(getattr(p, "packed", None), dict)
            for p in parts]
    if not parts or not all(held):
        return None
    qtype, (_, k) = parts[0].packed["weight"]
    rows = [p.packed["weight"][1][0] for p in parts]
    biased = [p.bias is not None for p in parts]
    if any(p.packed["weight"][0] != qtype or p.packed["weight"][1][1] != k or p.weight_int4.device.type != "cpu"
           for p in parts) or any(r % 64 for r in rows[:-1]) or (any(biased) and not all(biased)):
        return None
    fused = make(k, sum(rows), all(biased))
    with torch.no_grad():
        packed = torch.cat([p.weight_int4 for p in parts])
        sz = torch.cat([p.weight_int4_sz for p in parts], dim=1)
        if "weight" in fused._parameters:
            del fused._parameters["weight"]
        fused.register_buffer("weight_int4", packed, persistent=False)
        fused.register_buffer("weight_int4_sz", sz, persistent=False)
        fused.packed = {"weight": (qtype, (sum(rows), k))}
        fused.kernels = {"weight": "int4"}
        if all(biased):
            fused.bias = torch.nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        for p, codes in zip(parts, packed.split(rows)):
            p.weight_int4 = codes
    return fused
