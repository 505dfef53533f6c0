"""Micro-batched pipeline inside an engine step (GPipe-style): the step's batch runs as several forwards so the
stages overlap.

Without micro-batches a pipeline step is sequential: stage 1 waits while stage 0 runs the whole batch, and so on.
Here the scheduled sequences are cut into ``n`` contiguous groups of about equal token counts and each group is
one forward in the pipeline's deferred mode (pipeline.py): a stage sends a group's hidden states without waiting
and goes on with the next group, so stage s runs group m while stage s+1 runs group m-1. The last stage
concatenates the groups' logits (in the scheduled order, as one forward would return them) and broadcasts them
once. Every rank cuts the same groups (SPMD: the same scheduled batch), so the hand-offs pair up.

The engine's other forwards (speculative verification, beams, embeddings) are unchanged.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .pipeline import PipelineStack, broadcast_from_last, deferred


def split_balanced(sizes: Sequence[int], n: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) ranges of ``sizes`` in at most ``n`` non-empty groups of about equal sums."""
    n = max(1, min(n, len(sizes)))
    total, out, start, acc = sum(sizes), [], 0, 0
    for i, s in enumerate(sizes):
        acc += s
        left_items, left_groups = len(sizes) - i - 1, n - len(out) - 1
        # close a group at its share of the tokens, or when the rest just fills one group each
        if left_groups > 0 and (acc >= total * (len(out) + 1) / n or left_items == left_groups):
            out.append((start, i + 1))
            start = i + 1
    out.append((start, len(sizes)))
    return out


class MicroBatched:
    """A model runner whose ``run`` cuts a pipelined model's batch into micro-batches; everything else is the
    wrapped runner's."""

    def __init__(self, runner: Any, micro_batches: int):
        self.inner, self.micro_batches = runner, micro_batches
        self.micro_forwards = 0  # forwards run as micro-batches (a check that they happen)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def run(self, scheduled: Sequence[Any]) -> torch.Tensor:
        model = self.inner.model
        g = getattr(model, "parallel", None)
        if (g is None or g.num_stages < 2 or self.micro_batches < 2 or len(scheduled) < 2
                or not isinstance(getattr(model.net, "decoder", None), PipelineStack)):
            return self.inner.run(scheduled)
        groups = split_balanced([sc.num_tokens for sc in scheduled], self.micro_batches)
        with torch.inference_mode(), deferred(model.net):
            outs = [self.inner.run(scheduled[a:b]) for a, b in groups]
        self.micro_forwards += len(groups)
        logits = torch.cat(outs) if g.last else None
        return broadcast_from_last(logits, g, self.inner.device)


def use_micro_batches(engine: Any, micro_batches: int) -> None:
    """Run ``engine``'s steps as ``micro_batches`` pipelined micro-batches (a no-op without a pipeline)."""
    if micro_batches > 1 and not isinstance(engine.runner, MicroBatched):
        engine.runner = MicroBatched(engine.runner, micro_batches)
