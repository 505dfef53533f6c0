"""Cross-attention through the paged backend: each request keeps its encoder K/V in a ``cross`` dict of its own
(computed once, at its first step); decode batches attend to them padded, in one call."""
from __future__ import annotations

from typing import Callable

import torch
from torch.nn.utils.rnn import pad_sequence

from ..errors import InferflowError
from ..model.context import ForwardContext, attention_core


class PagedCrossAttention:
    """A mixin of ``PagedAttentionBackend`` (which provides ``cross``, ``_dense``, ``_plan_for``, ``_on``)."""

    def cross_kv(self, key: int, compute: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                 ctx: ForwardContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-sequence encoder K/V: from the request's dict, else computed once and stored there."""
        cross = self.cross
        if cross is None:  # nothing kept: compute for this forward only
            return self._dense.cross_kv(key, compute, ctx)
        if len(cross) != len(ctx.q_lens):
            raise InferflowError(f"paged attention: {len(cross)} cross dicts for {len(ctx.q_lens)} sequences")
        missing = [i for i, d in enumerate(cross) if key not in d]
        if missing:
            if ctx.encoder_out is None or ctx.enc_lens is None or len(ctx.enc_lens) != len(missing):
                got = None if ctx.enc_lens is None else len(ctx.enc_lens)
                raise InferflowError(f"paged attention: {len(missing)} sequence(s) lack cross K/V of layer {key}; "
                                     f"encoder outputs given for {got}")
            k, v = compute()
            ks, vs = self._split(k, ctx.enc_lens), self._split(v, ctx.enc_lens)
            for i, ki, vi in zip(missing, ks, vs):
                # clone when split: a view would keep the whole packed batch alive with the request
                cross[i][key] = (ki.clone(), vi.clone()) if len(missing) > 1 else (ki, vi)
        return [d[key] for d in cross]

    def cross_attention(self, key: int, q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]],
                        ctx: ForwardContext, *, scale: float, softcap: float | None = None) -> torch.Tensor:
        """Decode batches attend to their (padded) encoder K/V in one call; other batches per sequence."""
        if len(kv) < 2 or any(n != 1 for n in ctx.q_lens):
            return super().cross_attention(key, q, kv, ctx, scale=scale, softcap=softcap)
        lens = [ki.shape[0] for ki, _ in kv]
        k = pad_sequence([ki for ki, _ in kv], batch_first=True).transpose(1, 2)
        v = pad_sequence([vi for _, vi in kv], batch_first=True).transpose(1, 2)
        mask = None
        if min(lens) != max(lens):
            p = self._plan_for(ctx)
            mask = self._on(p, ("enc_mask", tuple(lens)), q.device,
                            lambda: torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None])
        o = attention_core(q[:, :, None, :], k, v, q_start=0, causal=False, scale=scale, softcap=softcap, key_mask=mask)
        return o[:, :, 0, :]
