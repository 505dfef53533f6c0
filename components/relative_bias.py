"""T5's bucketed relative position bias, one learned table shared by every layer of a stack."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferflow.component import Component
from inferflow.registry import register


def relative_bucket(rel: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> torch.Tensor:
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).long() * num_buckets
        rel = rel.abs()
    else:
        rel = -torch.clamp(rel, max=0)
    max_exact = num_buckets // 2
    small = rel < max_exact
    large = max_exact + (torch.log(rel.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(small, rel, large)


@register("relative_bias")
class RelativeBias(Component):
    @dataclass(slots=True)
    class Params:
        num_heads: int
        num_buckets: int = 32
        max_distance: int = 128
        bidirectional: bool = True

    def __init__(self, p: Params):
        super().__init__()
        self.p = p
        self.declare("weight", (p.num_buckets, p.num_heads))

    def bias_fn(self, ctx, causal: bool):
        def bias(qi: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
            b = relative_bucket(ki[None, :] - qi[:, None], self.p.bidirectional, self.p.num_buckets, self.p.max_distance)
            # the indices may live elsewhere than the table (paged KV layers attended on the host): look up
            # where the table is, return where the queries are
            return F.embedding(b.to(self.weight.device), self.weight).permute(2, 0, 1).to(qi.device)

        return bias

    def forward(self, x, ctx=None):  # pragma: no cover - used through bias_fn()
        return x
