"""The collective-aware wrappers tensor parallelism puts around sharded components.

Each wraps the original component (its weights already sliced) and adds the one collective its shard needs:
- ``RowParallel``: the input dimension is split, so each rank holds a partial sum: all-reduce, then add the bias
  once (the wrapped module's own bias was removed, else it would be added ``world`` times).
- ``GatherColumns``: the output dimension is split (a vocab-parallel head): all-gather the slices in rank order
  and drop the padding of an uneven split.
- ``VocabParallelEmbedding``: each rank holds a row range of the table; ids outside it give zeros; all-reduce.
- ``HeadSlicedPosition``: a position encoding that adds a per-head bias (ALiBi, relative buckets) computes all
  heads; a rank keeps only the bias of its own query heads.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    dist.all_reduce(x, group=group)
    return x


class RowParallel(nn.Module):
    def __init__(self, inner: nn.Module, group: Any, bias: torch.Tensor | None = None):
        super().__init__()
        self.inner, self.group = inner, group
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: Any, ctx: Any = None) -> torch.Tensor:
        y = self.inner(x, ctx)
        # gloo/NCCL reduce in place; the partial sum is a fresh tensor so nothing else sees it change
        y = all_reduce(y.contiguous(), self.group)
        return y + self.bias if self.bias is not None else y


class GatherColumns(nn.Module):
    def __init__(self, inner: nn.Module, group: Any, world: int, full: int, chunk: int):
        super().__init__()
        self.inner, self.group, self.world, self.full, self.chunk = inner, group, world, full, chunk

    def forward(self, x: Any, ctx: Any = None) -> torch.Tensor:
        y = self.inner(x, ctx)
        if y.shape[-1] < self.chunk:  # uneven split: equal slices for all_gather, padding cut after it
            y = torch.nn.functional.pad(y, (0, self.chunk - y.shape[-1]))
        y = y.contiguous()
        parts = [torch.empty_like(y) for _ in range(self.world)]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat(parts, dim=-1)[..., :self.full]


class VocabParallelEmbedding(nn.Module):
    def __init__(self, inner: nn.Module, group: Any, start: int, stop: int):
        super().__init__()
        self.inner, self.group, self.start, self.stop = inner, group, start, stop

    def forward(self, ids: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)
        local = (ids - self.start).clamp(0, max(self.stop - self.start - 1, 0))
        x = self.inner(local, ctx)
        x = x * mine.unsqueeze(-1).to(x.dtype)
        return all_reduce(x.contiguous(), self.group)


class HeadSlicedPosition(nn.Module):
    def __init__(self, inner: nn.Module, start: int, count: int):
        super().__init__()
        self.inner, self.start, self.count = inner, start, count
        if hasattr(inner, "rotate"):  # head-independent; attention looks for the attribute
            self.rotate = inner.rotate

    def bias_fn(self, ctx: Any, causal: bool):
        fn = self.inner.bias_fn(ctx, causal)
        if fn is None:
            return None

        def sliced(q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
            return fn(q_idx, k_idx).narrow(-3, self.start, self.count)

        return sliced
