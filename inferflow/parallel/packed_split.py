"""Slicing block-quantized (packed) weights for tensor parallelism, on block boundaries.

A :class:`~inferflow.quant.packed.PackedTensor` stores each row as whole blocks, so output rows (dim 0) split
anywhere while input columns (the last dim) split only at multiples of the format's block length (32 or 256
elements): a shard holds whole blocks, each still carrying its own scales. A module keeps its weight in the form
its kernel set chose (inferflow/quant/cpu_kernels.py): sliceable ggml blocks (``<name>_blocks``) or, for the fast
int4 kernel, a repacked form that cannot be sliced; :func:`held` reads the former, :func:`rehold` stores a slice
back under the kernel set in force (so a reference-loaded model can be sharded, then repacked fast).
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import InferflowError
from ..quant import ggml
from ..quant.packed import PackedTensor


def take_rows(t: PackedTensor, ranges: list[tuple[int, int]]) -> PackedTensor:
    """Rows ``ranges`` (concatenated in order) along dim 0: whole rows are whole blocks."""
    data = torch.cat([t.data[a:b] for a, b in ranges])
    return PackedTensor(data, t.qtype, (int(data.shape[0]), *t.shape[1:]))


def take_cols(t: PackedTensor, a: int, b: int, what: str = "weight") -> PackedTensor:
    """Columns [a, b) of the last dim; both ends must fall on block boundaries."""
    elems, nbytes = ggml.block_size(t.qtype)
    if a % elems or b % elems:
        raise InferflowError(f"{what}: a {t.type_name} weight splits only at multiples of {elems} columns, "
                             f"this shard needs [{a}, {b}) (use fewer ranks or a full-precision weight)")
    data = t.data[..., a // elems * nbytes:b // elems * nbytes].contiguous()
    return PackedTensor(data, t.qtype, (*t.shape[:-1], b - a))


def held(module: nn.Module, name: str, path: str) -> PackedTensor:
    """The packed weight ``name`` a module holds as ggml blocks."""
    blocks = getattr(module, f"{name}_blocks", None)
    if blocks is None:
        raise InferflowError(f"{path}: its {name} is repacked for a fast kernel and cannot be sliced; load with "
                             "quant_kernels='reference' (parallelize repacks the shards afterwards)")
    qtype, shape = module.packed[name]
    return PackedTensor(blocks, qtype, shape)


def rehold(module: nn.Module, name: str, t: PackedTensor, linear: bool, kernels: str | None = None) -> None:
    """Store slice ``t`` as the module's weight ``name`` the way loading would have (``kernels``: the kernel set,
    None for the environment's / default choice)."""
    from ..quant.cpu_kernels import hold_linear, using
    from ..quant.packed import hold

    for suffix in ("_blocks", "_int4", "_int4_sz", "_dense"):
        module._buffers.pop(f"{name}{suffix}", None)
    module.register_parameter(name, nn.Parameter(torch.empty(0), requires_grad=False))  # what hold() replaces
    if linear:
        with using(kernels):
            hold_linear(module, name, t)
    else:
        hold(module, name, t)
