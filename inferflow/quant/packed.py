"""A weight that stays in its file's block-quantized form until a layer uses it.

Loaders return a :class:`PackedTensor` for ggml block types; the weight loader hands it to
components that can hold raw blocks (linear layers, token embeddings), which dequantize one layer
at a time in the activation dtype. Everything else receives the dequantized tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from . import ggml


@dataclass(slots=True)
class PackedTensor:
    """``data``: uint8 [*shape[:-1], row_bytes], each row whole blocks; ``qtype``: ggml type id;
    ``shape``: the logical (PyTorch-order) shape."""

    data: torch.Tensor
    qtype: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        self.shape = tuple(int(s) for s in self.shape)
        elems, nbytes = ggml.block_size(self.qtype)
        if not self.shape or self.shape[-1] % elems:
            raise ValueError(f"{ggml.type_name(self.qtype)} rows must hold whole {elems}-element blocks, "
                             f"got shape {list(self.shape)}")
        want = (*self.shape[:-1], self.shape[-1] // elems * nbytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise ValueError(f"packed {ggml.type_name(self.qtype)} data for shape {list(self.shape)} must be uint8 "
                             f"{list(want)}, got {self.data.dtype} {list(self.data.shape)}")

    @property
    def type_name(self) -> str:
        return ggml.type_name(self.qtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return len(self.shape)

    def is_floating_point(self) -> bool:
        return False

    def to(self, device: torch.device | str) -> "PackedTensor":
        return PackedTensor(self.data.to(device), self.qtype, self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ggml.dequantize(self.data, self.qtype, self.shape, dtype)

    def with_rows(self, rows: torch.Tensor) -> "PackedTensor":
        """The same type over a new byte matrix (rows permuted, split or concatenated along dim 0)."""
        return PackedTensor(rows, self.qtype, (rows.shape[0], *self.shape[1:]))

    def __repr__(self) -> str:
        return f"PackedTensor({self.type_name}, shape={list(self.shape)}, {self.nbytes} bytes)"


def dequantize_rows(data: torch.Tensor, qtype: int, row_len: int, ids: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (any shape) of a packed 2-D table -> [*ids.shape, row_len]: only those rows are decoded."""
    picked = data.index_select(0, ids.reshape(-1))
    return ggml.dequantize(picked, qtype, (*ids.shape, row_len), dtype)


def dense(t: "torch.Tensor | PackedTensor") -> torch.Tensor:
    """A plain float32 tensor for consumers that cannot hold blocks."""
    return t.dequantize(torch.float32) if isinstance(t, PackedTensor) else t


def cat_rows(parts: Sequence["torch.Tensor | PackedTensor"]) -> "torch.Tensor | PackedTensor":
    """Concatenate along dim 0; packed parts of one type and row length stay packed."""
    if all(isinstance(p, PackedTensor) for p in parts):
        first = parts[0]
        if all(p.qtype == first.qtype and p.shape[1:] == first.shape[1:] and p.dim() == 2 for p in parts):
            return first.with_rows(torch.cat([p.data for p in parts], dim=0))
    parts = [dense(p) for p in parts]
    return torch.cat([p.to(parts[0].dtype) for p in parts], dim=0)


# ---- components that hold raw blocks ---------------------------------------------------------------
# A component opts in with ``load_packed(name, packed, dtype) -> bool`` (called by the weight loader)
# and reads the weight back with :func:`unpack`. The blocks live in a non-persistent buffer
# ``<name>_blocks``, so ``module.to(device)`` moves them and no float copy is ever kept.

def hold(module: torch.nn.Module, name: str, t: PackedTensor) -> None:
    """Replace the declared (meta) parameter ``name`` of ``module`` by the raw blocks of ``t``."""
    del module._parameters[name]
    module.register_buffer(f"{name}_blocks", t.data, persistent=False)
    module.packed = {**(getattr(module, "packed", None) or {}), name: (t.qtype, t.shape)}


def unpack(module: torch.nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
    """The held weight ``name``, dequantized now (a transient tensor in ``dtype``)."""
    qtype, shape = module.packed[name]
    return ggml.dequantize(getattr(module, f"{name}_blocks"), qtype, shape, dtype)


# Larger weights are decoded in row chunks of about this many elements, each used at once: the
# transient float copy stays small (and reused by the allocator) instead of one table-sized buffer per call.
CHUNK_ELEMS = 1 << 20


def packed_linear(module: torch.nn.Module, name: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for a held weight ``W``, dequantized chunk by chunk in ``x.dtype``."""
    qtype, shape = module.packed[name]
    blocks = getattr(module, f"{name}_blocks")
    rows = max(1, CHUNK_ELEMS // shape[1])
    if shape[0] <= rows:
        return torch.nn.functional.linear(x, ggml.dequantize(blocks, qtype, shape, x.dtype), bias)
    outs = [torch.nn.functional.linear(x, ggml.dequantize(blocks[r:r + rows], qtype, (min(rows, shape[0] - r), shape[1]),
                                                          x.dtype), None if bias is None else bias[r:r + rows])
            for r in range(0, shape[0], rows)]
    return torch.cat(outs, dim=-1)


def unpack_rows(module: torch.nn.Module, name: str, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of the held 2-D weight ``name`` (embedding lookup without decoding the table)."""
    qtype, shape = module.packed[name]
    return dequantize_rows(getattr(module, f"{name}_blocks"), qtype, shape[-1], ids, dtype)
