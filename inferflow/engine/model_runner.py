"""Turns a scheduled batch into ONE packed forward pass through the paged KV cache.

The new tokens of every scheduled sequence (decodes: one; prefill chunks: many) are concatenated into one
stream with their positions and KV slots; only the rows that produce a next token (a sequence's last token)
go through the head. Encoder-decoder requests run their encoder once, at their first step, batched with
the other new requests of that step; the cross-attention K/V then stay in the request's ``cross`` dict.
"""
from __future__ import annotations

from array import array
from typing import Any, Sequence

import torch

from ..model.pooling import pool_hidden, pooling_for
from ..model.fuse import fuse_projections
from .cuda_graphs import DecodeGraphs
from .kv_cache import PagedKVCache
from . import varlen
from .paged_backend import PagedAttentionBackend
from .scheduler import Scheduled
from .static_decode import decode_items, pure_decode, token_rows


class ModelRunner:
    def __init__(self, model: Any, cache: PagedKVCache, config: Any = None, max_model_len: int | None = None):
        """``config`` (an EngineConfig) switches on the GPU fast path: fused projections and decode graphs."""
        self.model, self.cache = model, cache
        self.device = model.device
        self.encoder_decoder = model.architecture == "encoder_decoder"
        # a request's encoder ran for this model once its first cross-attention key is in the request's ``cross``
        # dict (a draft model keeps its own keys in the same dict)
        self.cross_key = min((m.cache_key for m in model.net.modules() if getattr(m, "cross", False)
                              and getattr(m, "uses_kv_cache", False)), default=None)
        cuda = self.device.type == "cuda"
        # fused projections pay on the CPU too (fewer, larger GEMMs: -15% GEMM time for an 8-row decode step)
        if config is not None and (config.fuse_projections if config.fuse_projections is not None else True):
            fuse_projections(model.net)
        if config is not None and self.device.type == "cpu":
            from ..model.cpu_prepack import prepack_linears
            from ..model.hugepages import drop_file_pages, move_module

            if move_module(model.net):  # weights in huge pages, before anything records their addresses
                drop_file_pages(getattr(model.source, "mapped", list)())
            prepack_linears(model.net)  # bf16 linears: oneDNN-packed weights for batches
        if config is not None and (config.fuse_add_norm if config.fuse_add_norm is not None else cuda):
            from ..model.fuse_add_norm import fuse_add_norms  # imports Triton: only when asked for

            fuse_add_norms(model.net)  # no-op with $INFERFLOW_FUSE_ADD_NORM=0
        # a CPU decode step as one native call (model/native_decode.py), where every step of the model lowers
        self.native = None
        if (config is not None and self.device.type == "cpu" and getattr(config, "native_decode", None) is not False
                and not self.encoder_decoder and not config.host_embeddings):
            from ..model.native_decode import NativeDecoder

            self.native = NativeDecoder.build(model, cache)
        # static decode steps on CUDA (graph replays, or eager with cuda_graphs off: still the Triton paged kernel);
        # not for encoder-decoders (per-request cross K/V), host-resident KV layers or embedding tables. Overlapped
        # decode (overlap.py) runs on them: forced on elsewhere (CPU tests), they run eagerly with torch attention
        self.graphs: DecodeGraphs | None = None
        forced = config is not None and getattr(config, "async_scheduling", None) is True
        if (config is not None and (cuda or forced) and max_model_len and not self.encoder_decoder
                and not cache.host_layers and not config.host_embeddings):
            self.graphs = DecodeGraphs(model, cache, config.max_num_seqs, max_model_len, graphs=config.cuda_graphs,
                                       use_kernel=None if cuda else False,
                                       chained_rows=config.graph_prefill_tokens if cuda and config.cuda_graphs else 0,
                                       sizes=config.cuda_graph_sizes)
        if cuda:
            varlen.warm_up(self.device, model.dtype)
        if self.graphs is not None and getattr(config, "capture_graphs_at_start", False):
            self.graphs.capture_all(cache.pool)  # no capture stalls a serving step later

    def run(self, scheduled: Sequence[Scheduled]) -> torch.Tensor:
        """float32 logits [R, vocab] for the scheduled sequences whose chunk ends at their last token, in order."""
        g = self.graphs
        if g is not None and pure_decode(scheduled):
            items = decode_items(scheduled)
            if g.fits(len(items), max(p for _, p, _ in items) + 1):
                return g.run(items)
        return self.forward([(seq, sc.start, seq.tokens(sc.start, sc.start + sc.num_tokens),
                              int(sc.start + sc.num_tokens == seq.num_tokens)) for sc in scheduled for seq in (sc.seq,)])

    def forward(self, items: Sequence[tuple[Any, int, list[int], int]]) -> torch.Tensor:
        """One pass over ``(sequence, first position, new token ids, rows)`` items: float32 logits of each item's
        last ``rows`` tokens, in order. The ids need not be the sequence's own (speculative drafts).

        A pass of few new tokens in all (prefill chunks, mixed steps, speculative verification) runs each token as
        a decode row of one step: the CPU's native step, or on CUDA (up to ``graph_prefill_tokens``) a replay of
        the static step's graph, whose host time is a fraction of an eager pass's (docs/benchmarks.md)."""
        nd = self.native
        if (nd is not None and sum(len(t) for _, _, t, _ in items) > nd.max_rows
                and sum(len(t) == 1 for _, _, t, _ in items) > 1):
            return self._decode_rows_apart(items, nd.max_rows)
        return self._pass(items)

    def _pass(self, items: Sequence[tuple[Any, int, list[int], int]]) -> torch.Tensor:
        """:meth:`forward` as one pass: the native step, a chained graph replay or the eager pass."""
        n = sum(len(t) for _, _, t, _ in items)
        nd, g = self.native, self.graphs
        if nd is not None and n <= nd.max_rows:
            rows, keep = token_rows(items)
            logits = nd.decode([t for _, _, t in rows], [p for _, p, _ in rows], [s.block_table for s, _, _ in rows])
            return logits if len(keep) == len(rows) else logits[keep]
        if g is not None and 0 < n <= g.chained_rows:
            rows, keep = token_rows(items)
            if g.fits_chained(len(rows), max(p for _, p, _ in rows) + 1):
                logits = g.run(rows, chained=True)
                return logits if len(keep) == len(rows) else logits[keep]
        return self.forward_eager(items)

    def _decode_rows_apart(self, items: Sequence[tuple[Any, int, list[int], int]], most: int) -> torch.Tensor:
        """:meth:`forward` of a pass with more rows than the native step takes: its one-token items (decode rows)
        in native calls of up to ``most`` rows, the other items as a pass of their own; logits in item order.

        Why: op by op, a decode step of 32 sequences of the default model ran at a third of the native step's
        throughput at 8 (docs/benchmarks.md). The native step is batch-invariant, so the rows' logits are the same
        bits in any grouping; items of different sequences are independent, so the order of the calls is free."""
        singles = [i for i, (_, _, t, _) in enumerate(items) if len(t) == 1]
        rest = sorted(set(range(len(items))) - set(singles))
        groups = [singles[j:j + most] for j in range(0, len(singles), most)] + ([rest] if rest else [])
        out: list[torch.Tensor] = [torch.empty(0)] * len(items)
        for idx in groups:
            logits = self._pass([items[i] for i in idx])
            for i, part in zip(idx, torch.split(logits, [items[i][3] for i in idx])):
                out[i] = part
        return torch.cat(out)

    def forward_eager(self, items: Sequence[tuple[Any, int, list[int], int]]) -> torch.Tensor:
        """:meth:`forward` as one packed eager pass: the new tokens in one stream, attention through the paged
        cache, only the returned rows through the head."""
        bs = self.cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens, k_lens, tables, rows = [], [], [], []
        for seq, s, toks, nrows in items:
            table = seq.block_table
            if nrows == 1 and len(toks) == 1:  # a decode: skip the range/list machinery (O(batch) per step)
                ids.append(toks[0])
                positions.append(s)
                slots.append(table[s // bs] * bs + s % bs)
                q_lens.append(1)
                k_lens.append(s + 1)
                tables.append(table)
                rows.append(len(ids) - 1)
                continue
            e = s + len(toks)
            ids += toks
            positions += range(s, e)
            for j in range(s // bs, (e - 1) // bs + 1):  # one range per block: O(blocks) Python steps, not O(tokens)
                base = table[j] * bs - j * bs
                slots += range(base + max(s, j * bs), base + min(e, j * bs + bs))
            q_lens.append(e - s)
            k_lens.append(e)
            tables.append(table)
            rows += range(len(ids) - nrows, len(ids))
        cross, enc_out, enc_lens = None, None, None
        if self.encoder_decoder:
            cross = [seq.request.cross for seq, *_ in items]
            new = [seq.request.encoder_ids for seq, *_ in items if self.cross_key not in seq.request.cross]
            if new:  # every new request's encoder in one batch
                enc_out, enc_lens = self.model.encode_packed(new)
        # ONE host->device copy for ids, positions, slots and rows (views of it), not four
        n = len(ids)
        # through array('q'): 4x faster than torch.tensor on a list (2 ms per 8k-token prefill step)
        flat = array("q", ids + positions + slots + rows)
        packed = (torch.frombuffer(flat, dtype=torch.long) if flat else torch.empty(0, dtype=torch.long)).to(self.device)
        backend = PagedAttentionBackend(self.cache, tables, packed[2 * n:3 * n], cross=cross)
        return self.model.forward_packed(packed[:n], packed[n:2 * n], q_lens, k_lens, backend,
                                         encoder_out=enc_out, enc_lens=enc_lens, rows=packed[3 * n:])

    @torch.inference_mode()
    def embed(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Pooled embeddings [n, hidden] of an encoder batch, pooled as ``Model.embed`` does."""
        pool = pooling_for(self.model.source, self.model.spec.data.get("pooling"))
        hidden, lens = self.model.encode_packed(ids)
        return pool_hidden(hidden.float(), lens, pool)

    @torch.inference_mode()
    def encoder_batch(self, ids: Sequence[Sequence[int]],
                      masks: Sequence[Sequence[int] | None]) -> list[torch.Tensor]:
        """One encoder pass for a mixed batch: per input, its pooled embedding [hidden] (``masks[i]`` None) or
        the float32 head logits [M, vocab] at its masked positions ``masks[i]`` (only those rows go through
        the head: an MLM head's vocab projection is the costly part)."""
        hidden, lens = self.model.encode_packed(ids)
        out: list[torch.Tensor] = [None] * len(lens)  # type: ignore[list-item]
        if any(m is None for m in masks):
            pool = pooling_for(self.model.source, self.model.spec.data.get("pooling"))
            vecs = pool_hidden(hidden.float(), lens, pool)
            for i, m in enumerate(masks):
                if m is None:
                    out[i] = vecs[i]
        starts = [sum(lens[:i]) for i in range(len(lens))]
        rows = [starts[i] + p for i, m in enumerate(masks) if m is not None for p in m]
        if rows:
            logits = self.model.head_logits(hidden.index_select(0, torch.tensor(rows, device=hidden.device)))
            parts = iter(logits.split([len(m) for m in masks if m is not None]))
            for i, m in enumerate(masks):
                if m is not None:
                    out[i] = next(parts)
        return out
