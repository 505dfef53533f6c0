"""Embedding tables: tokens, token types (BERT segments) and learned absolute positions."""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from inferflow.component import Component
from inferflow.quant.packed import hold, unpack_rows
from inferflow.registry import register


@register("token_embedding")
class TokenEmbedding(Component):
    @dataclass(slots=True)
    class Params:
        vocab_size: int
        dim: int
        scale: float | None = None

    packed = None  # {"weight": (ggml type, shape)} when the table is held as GGUF blocks
    # The table may be kept in host RAM while the rest of the model runs on a GPU (Inferflow's host embeddings,
    # inferflow/model/placement.py): it is large and read a few rows per step, so VRAM is better spent elsewhere.
    host_placeable = True

    def __init__(self, p: Params):
        super().__init__()
        self.scale = p.scale
        self.declare("weight", (p.vocab_size, p.dim))

    def load_packed(self, name, t, dtype) -> bool:
        """Keep a block-quantized table packed; a lookup decodes only the rows it reads."""
        hold(self, name, t)
        self.out_dtype = dtype
        return True

    def forward(self, ids, ctx=None):
        # Look up where the table lives and move only the [N, dim] rows to the ids' (compute) device; with
        # the table on the compute device (or on a CPU-only machine) both moves are no-ops.
        table = self.weight_blocks if self.packed is not None else self.weight
        at = ids.to(table.device)
        if self.packed is not None:
            x = unpack_rows(self, "weight", at, self.out_dtype)
        else:
            x = F.embedding(at, table)
        x = x.to(ids.device)
        # HF scales in the hidden dtype (Gemma builds the factor as a tensor of that dtype)
        return x * x.new_tensor(self.scale) if self.scale is not None else x


@register("token_type_embedding")
class TokenTypeEmbedding(Component):
    """Segment embeddings; reads ``token_type_ids`` (zeros when the caller gives none)."""

    @dataclass(slots=True)
    class Params:
        num_types: int
        dim: int

    def __init__(self, p: Params):
        super().__init__()
        self.declare("weight", (p.num_types, p.dim))

    def forward(self, ids, ctx=None):
        return F.embedding(ids, self.weight)


@register("learned_positions")
class LearnedPositions(Component):
    """Absolute position table; ``offset`` shifts the index (OPT and BART start at 2)."""

    @dataclass(slots=True)
    class Params:
        num_positions: int
        dim: int
        offset: int = 0

    def __init__(self, p: Params):
        super().__init__()
        self.offset = p.offset
        self.declare("weight", (p.num_positions + p.offset, p.dim))

    def forward(self, positions, ctx=None):
        return F.embedding(positions + self.offset if self.offset else positions, self.weight)
