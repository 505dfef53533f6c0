"""The decode step with static shapes: what a CUDA graph captures (cuda_graphs.py), also runnable eagerly.

A pure-decode batch of ``n`` sequences runs padded to a bucket of ``B >= n`` rows. A short step with prefill chunks
can run here too (``chained``), each new token a decode row at its position whose keys end at itself, as the CPU's
native step does (model_runner.py). Every per-step input lives
in one persistent device buffer (token ids, positions, KV slots, key counts and block tables padded to the
widest table ``max_model_len`` needs), filled by ONE host->device copy from a pinned staging buffer. Nothing
in the step reads a Python value that changes between steps, and nothing syncs with the host, so the same
kernels with the same pointers serve every step of that bucket.

Padded rows repeat row 0 (its token, position, slot and table): they compute row 0's values again and write
the same K/V to row 0's slot, so no spare block is needed and nothing else in the cache is touched. Their
logits are dropped.

An overlapped step (overlap.py) does not know its token ids on the host: ``feed`` gathers them on the device from
the previous step's sampled tokens (row i takes ``prev[src[i]]``, ``src`` staged with the rest), after the copy.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Sequence

import torch

from ..model.context import AttentionBackend, BiasFn, ForwardContext, attention_core
from .kv_cache import PagedKVCache

FUSE_ENV = "INFERFLOW_FUSE_QK_ATTENTION"  # =0: q/k norm + RoPE stay a kernel of their own before the attention
_fuse = {"ok": True}


class StaticDecodeBackend(AttentionBackend):
    """Self-attention for decode rows from static tensors: slots [B], tables [B, W], lens [B] (keys incl. new)."""

    def __init__(self, cache: PagedKVCache, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 max_len: int, use_kernel: bool, chained: bool = False):
        super().__init__()
        self.cache, self.slots, self.tables, self.lens, self.max_len = cache, slots, tables, lens, max_len
        self.use_kernel = use_kernel
        # chained: rows of one sequence (a prefill chunk, each token a row) attend to K/V that other rows of the
        # step store, so every row's K/V is stored before any row attends (not inside the attention kernel)
        self.chained = chained
        self._memo: dict = {}

    def self_attention(self, key: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, *,
                       causal: bool, scale: float, window: int | None = None, softcap: float | None = None,
                       bias_fn: BiasFn | None = None) -> torch.Tensor:
        kv = self.cache
        kv.write(key, self.slots, k, v)
        store = kv._dev[key]  # the layer's [blocks, block_size, Hkv, D] K/V (read in place by the kernel)
        if self.use_kernel and bias_fn is None and store.device == q.device:
            from . import triton_attention  # imports Triton: only where the kernel runs

            ks, vs = kv.scale_stores(key) or (None, None)  # an int8 cache's row scales
            return triton_attention.paged_decode(q, store.k, store.v, self.tables, self.lens, scale=scale,
                                                 max_len=self.max_len, softcap=softcap, window=window,
                                                 k_scales=ks, v_scales=vs)
        # torch path: gather the whole static width, mask keys past each row's length (and outside its window)
        bs = kv.block_size
        memo = self._memo
        if "idx" not in memo:
            pos = torch.arange(self.tables.shape[1] * bs, device=self.tables.device)
            memo["kpos"], memo["qpos"] = pos, self.lens - 1
            memo["idx"] = self.tables[:, pos // bs] * bs + pos % bs
            memo["mask"] = pos[None, :] < self.lens[:, None]
        mask = memo["mask"]
        if window is not None:
            mask = mask & (memo["kpos"][None, :] > memo["qpos"][:, None] - window)
        kk, vv = kv.gather_idx(key, memo["idx"].to(kv.storage_device(key)))
        cdev = kk.device
        bias = None
        if bias_fn is not None:
            bias = bias_fn(memo["qpos"].to(cdev), memo["kpos"].to(cdev)).transpose(0, 1)[:, :, None, :]
        o = attention_core(q.to(cdev)[:, :, None, :], kk.transpose(1, 2), vv.transpose(1, 2), q_start=0, causal=False,
                           scale=scale, softcap=softcap, bias=bias, key_mask=mask.to(cdev))
        return o[:, :, 0, :].to(q.device)

    def norm_rope_attention(self, attn: Any, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """Attention of ``attn`` (a self-attention with per-head q/k RMSNorm and rotate-half RoPE) straight from its
        fused projection's rows [B, (H + 2 Hkv) D]: q/k norms, RoPE, the K/V store and the attention in ONE kernel
        (triton_attention.paged_decode_norm_rope) instead of two. None where that does not apply (the caller runs
        the separate steps): no kernel here, an int8 or remote cache, another pattern (fused_qk_rope.cos_sin),
        ``INFERFLOW_FUSE_QK_ATTENTION=0``, an earlier failure of the kernel, or fewer (row, KV head) programs than
        SMs. Measured on an H200 (docs/benchmarks.md): at batch 64 one launch takes 0.617 ms per step against
        0.682 for the two; at batch 1 it takes 0.361 against 0.323, since there every step of the kernel waits on
        the one before and norm + RoPE add to that chain."""
        from ..model import fused_qk_rope

        kv, key, h, hkv, d = self.cache, attn.cache_key, attn.h, attn.hkv, attn.d
        store = kv._dev.get(key)
        if (self.chained or not self.use_kernel or not _fuse["ok"] or os.environ.get(FUSE_ENV, "1") == "0"
                or not fused_qk_rope.wanted(qkv) or os.environ.get(fused_qk_rope.KV_ENV, "1") == "0"
                or store is None or kv.quantized or store.device != qkv.device or not store.k.is_floating_point()
                or qkv.dim() != 2 or qkv.shape[1] != (h + 2 * hkv) * d or qkv.stride(-1) != 1
                or d < 16 or d & (d - 1) or qkv.shape[0] != self.slots.shape[0]):
            return None
        from . import triton_attention

        if qkv.shape[0] * hkv < triton_attention._sms(qkv.device):
            return None  # latency-bound (batch 1 on an H200): the norm + RoPE chain would lengthen the attention's
        cs = fused_qk_rope.cos_sin(attn, qkv[:, :h * d], qkv[:, h * d:(h + hkv) * d], ctx)
        if cs is None:
            return None
        qn = attn.q_norm
        try:
            return triton_attention.paged_decode_norm_rope(
                qkv, h, qn.weight, attn.k_norm.weight, qn.eps, qn.offset, qn.weight_in_float, cs[0], cs[1],
                self.slots, store.k, store.v, self.tables, self.lens, scale=attn.scale, max_len=self.max_len,
                softcap=attn.softcap, window=attn.window)
        except Exception as e:  # noqa: BLE001 - compile/launch failure: the two kernels from now on
            _fuse["ok"] = False
            warnings.warn(f"fused q/k norm + RoPE + attention kernel failed ({type(e).__name__}: {e}); using "
                          f"separate kernels (set {FUSE_ENV}=0 to skip it)", RuntimeWarning, stacklevel=2)
            return None


class StaticDecode:
    """Persistent inputs of the static decode step for up to ``max_batch`` rows; ``prepare`` + ``forward``."""

    def __init__(self, model: Any, cache: PagedKVCache, max_batch: int, max_model_len: int,
                 use_kernel: bool | None = None):
        self.model, self.cache = model, cache
        self.max_batch, self.max_len = max_batch, max_model_len
        self.width = -(-max_model_len // cache.block_size)      # block-table columns
        dev = model.device
        if use_kernel is None:
            from . import triton_attention

            use_kernel = triton_attention.available(dev)
        self.use_kernel = use_kernel
        n = max_batch * (5 + self.width)  # ids, positions, slots, key counts, feed rows, tables
        self.dev_buf = torch.zeros(n, dtype=torch.long, device=dev)
        pin = dev.type == "cuda"
        # two staging buffers: the next step fills one while the last copy may still read the other
        self.host = [torch.zeros(n, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self.flip = 0
        B = max_batch
        self.ids, self.pos, self.slots, self.lens, self.src = (self.dev_buf[i * B:(i + 1) * B] for i in range(5))
        self.tables = self.dev_buf[5 * B:].view(B, self.width)

    def fits(self, n: int, longest: int) -> bool:
        return n <= self.max_batch and longest <= self.max_len

    def prepare(self, items: Sequence[tuple[Any, int, int]], rows: int,
                feed: tuple[torch.Tensor, Sequence[int]] | None = None) -> None:
        """Stage ``(sequence, position, token)`` items, padded to ``rows`` rows by repeating the first item.
        ``feed = (prev, src)``: the token ids are ``prev[src]`` (a device tensor; the items' tokens are ignored)."""
        host = self.host[self.flip]
        self.flip ^= 1
        a = host.numpy()
        B, W, bs = self.max_batch, self.width, self.cache.block_size
        n = len(items)
        tabs = a[5 * B:].reshape(B, W)
        prev, run = None, 0
        for i, (seq, p, tok) in enumerate(items):
            table = seq.block_table
            a[i], a[B + i], a[2 * B + i], a[3 * B + i] = tok, p, table[p // bs] * bs + p % bs, p + 1
            if table is not prev:  # a chained step's rows share their sequence's table: one copy per run of rows
                if i - run > 1:
                    tabs[run + 1:i] = tabs[run]
                tabs[i, :len(table)] = table
                prev, run = table, i
        if n - run > 1:
            tabs[run + 1:n] = tabs[run]
        if feed is not None:
            a[4 * B:4 * B + n] = feed[1]
        if rows > n:
            for j in range(5):
                a[j * B + n:j * B + rows] = a[j * B]
            tabs[n:rows] = tabs[0]
        end = 5 * B + rows * W
        self.dev_buf[:end].copy_(host[:end], non_blocking=True)
        if feed is not None:  # after the copy on the same stream: overwrites the staged (unknown) ids
            torch.index_select(feed[0], 0, self.src[:rows], out=self.ids[:rows])

    def forward(self, rows: int, chained: bool = False) -> torch.Tensor:
        """float32 logits [rows, vocab] of the staged batch (static shapes; capturable). ``chained``: rows may be
        tokens of one sequence (see StaticDecodeBackend)."""
        backend = StaticDecodeBackend(self.cache, self.slots[:rows], self.tables[:rows], self.lens[:rows],
                                      self.max_len, self.use_kernel, chained)
        ones = [1] * rows
        return self.model.forward_packed(self.ids[:rows], self.pos[:rows], ones, ones, backend)


def pure_decode(scheduled: Sequence[Any]) -> bool:
    """Every scheduled chunk is one token that produces the sequence's next token."""
    return bool(scheduled) and all(sc.num_tokens == 1 and sc.samples for sc in scheduled)


def decode_items(scheduled: Sequence[Any]) -> list[tuple[Any, int, int]]:
    return [(sc.seq, sc.start, sc.seq.tokens(sc.start, sc.start + 1)[0]) for sc in scheduled]


def token_rows(items: Sequence[tuple[Any, int, Sequence[int], int]]) -> tuple[list[tuple[Any, int, int]], list[int]]:
    """Every token of ``(sequence, first position, token ids, rows)`` pass items (ModelRunner.forward's) as a
    ``(sequence, position, token)`` decode row, and the rows whose logits the pass returns: each item's last
    ``rows``, in order."""
    out: list[tuple[Any, int, int]] = []
    keep: list[int] = []
    for seq, s, toks, nrows in items:
        if not toks:
            raise ValueError("a pass item without tokens")
        out += zip([seq] * len(toks), range(s, s + len(toks)), toks)
        keep += range(len(out) - nrows, len(out))
    return out, keep

