"""Decode rows (one new token each) of the paged backend: all of a step's decode rows attend in one call.

Three ways, first that applies: on the CPU a pure-decode step's K/V write and attention are one native call
(``native/cpu_ops.py``), and so are the decode rows and the chunks on cached keys (prefix-cache hits, speculative
verification, a long prompt's later chunks: each token a decode row over its causal limit) of any other step; on
CUDA the Triton paged decode kernel (``triton_attention.paged_decode``, the kernel of the decode graphs) reads each
row's keys in place through its block table, so a mixed step's decode rows need no gather; otherwise one padded
gather of the rows' K/V and one SDPA call with a per-row key mask (ALiBi / relative biases, host-resident K/V). That
gather path costs ~0.21 ms per layer on an H200 for 64 rows of 1k keys (bf16, 8 KV heads x 128): the K/V read and
written once, then read again by SDPA.
"""
from __future__ import annotations

import warnings
from array import array
from typing import Any

import torch

from ..model.context import BiasFn, attention_core

# devices whose decode rows may take the Triton kernel (tests add "cpu" under TRITON_INTERPRET=1)
KERNEL_DEVICES = ("cuda",)
_kernel = {"ok": True}


class DecodeRows:
    """A mixin of ``PagedAttentionBackend`` (which provides ``cache``, ``block_tables``, ``slot_mapping``, ``_on``)."""

    def _dec_base(self, p: Any) -> None:
        """The decode rows' padded slot indices, key mask, query and key positions (on the cache's device)."""
        if ("dec_idx", None) in p.memo:
            return
        lens = [p.ctx.k_lens[i] for i in p.dec]
        dev = self.cache.device
        tables = self.block_tables
        if isinstance(tables, torch.Tensor):
            rows = tables if p.pure else tables.index_select(0, torch.tensor(p.dec, device=tables.device))
        else:
            rows = [tables[i] for i in p.dec]
        if len(p.dec) == 1:  # a lone decode whose blocks are consecutive reads its K/V as views (no gather)
            p.memo["dec_run"] = self.cache.run_start(rows[0], lens[0], self.cache.block_size)
        idx, mask = self.cache.slot_index(rows, lens, dev)
        p.memo.update({("dec_idx", None): idx, ("dec_mask", None): mask,
                       ("dec_qpos", None): torch.tensor(lens).to(dev) - 1,
                       ("dec_kpos", None): torch.arange(p.lmax, device=dev)})

    def _dec(self, p: Any, name, device: torch.device) -> torch.Tensor:
        self._dec_base(p)
        return self._on(p, name, device, lambda: None)

    def _native_batch(self, p: Any):
        """The pure-decode CPU batch's block tables, key counts and slots for the native kernel (validated once per
        forward: cpu_ops.DecodeBatch); None: not served."""
        from ..native.cpu_ops import DecodeBatch

        t, slots = self.block_tables, self.slot_mapping
        if isinstance(t, torch.Tensor):
            if t.device.type != "cpu" or t.dim() != 2:
                return None
            tables = t.to(torch.int64)
        else:
            width = max(1, max(len(r) for r in t))
            tables = torch.tensor([list(r) + [0] * (width - len(r)) for r in t], dtype=torch.int64)
        if slots.device.type != "cpu":
            return None
        try:
            return DecodeBatch(tables, torch.tensor(p.ctx.k_lens, dtype=torch.int64), slots.to(torch.int64),
                               self.cache.block_size, self.cache.num_blocks)
        except ValueError:
            return None

    def _native_decode(self, key: int, p: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       scale: float, window: int | None = None) -> torch.Tensor | None:
        """A pure-decode CPU batch's K/V write and attention over its blocks, read in place, as one native call
        (inferflow/native/cpu_ops.py; float32 softmax, per-sequence results independent of the batch); None: the
        torch path runs (native ops off, quantized or off-CPU K/V, a dtype the kernel does not take)."""
        from ..native import cpu_ops

        kv = self.cache
        if not cpu_ops.enabled_all() or kv.compute_device(key).type != "cpu":
            return None
        batch = p.memo.get("native", False)
        if batch is False:
            batch = p.memo["native"] = self._native_batch(p)
        if batch is None:
            return None
        scales = kv.scale_stores(key)  # an int8 cache's row scales: the kernel quantizes the new rows itself
        st = kv._dev[key]
        if st.device.type != "cpu":
            return None
        kf, vf = st.k.view(-1, *st.k.shape[2:]), st.v.view(-1, *st.v.shape[2:])  # the kernel stores k/v itself
        return cpu_ops.paged_decode(q, k, v, kf, vf, batch, scale, window, *(scales or ()))

    def _native_rows(self, key: int, p: Any, q: torch.Tensor, scale: float,
                     window: int | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A CPU step's decode rows and chunks on cached keys as ONE native call, their K/V already written: token i
        of a chunk of q_len tokens on k_len keys is a decode row over the first k_len - q_len + i + 1 keys (its
        causal limit), read in place, instead of a gather, a mask and an SDPA call per chunk. -> (their outputs,
        their token indices; None: every token of the step); None: not served (the torch paths run)."""
        from ..native import cpu_ops

        kv = self.cache
        if not cpu_ops.enabled_all() or kv.compute_device(key).type != "cpu" or kv.storage_device(key).type != "cpu":
            return None
        plan = p.memo.get("native_rows", False)
        if plan is False:
            plan = p.memo["native_rows"] = self._native_rows_batch(p, q.shape[0])
        if plan is None:
            return None
        batch, tok = plan
        st = kv._dev[key]
        kf, vf = st.k.view(-1, *st.k.shape[2:]), st.v.view(-1, *st.v.shape[2:])
        out = cpu_ops.paged_decode(q if tok is None else q.index_select(0, tok), None, None, kf, vf, batch, scale,
                                   window, *(kv.scale_stores(key) or ()))
        return None if out is None else (out, tok)

    def _native_rows_batch(self, p: Any, tokens: int):
        """(DecodeBatch of one row per token of the decode rows and chunks, their token indices or None); None when
        the cache's checks refuse it."""
        from ..native.cpu_ops import DecodeBatch

        ctx, bt = p.ctx, self.block_tables
        if self.slot_mapping.device.type != "cpu" or (isinstance(bt, torch.Tensor) and bt.device.type != "cpu"):
            return None  # a GPU model's CPU layers: copying these back would wait on the device
        rows = sorted([*p.dec, *(r[0] for r in p.chunks)])
        tok, lens, which = array("q"), array("q"), array("q")
        for i in rows:
            ql, kl, s = ctx.q_lens[i], ctx.k_lens[i], p.starts[i]
            tok.extend(range(s, s + ql))
            lens.extend(range(kl - ql + 1, kl + 1))
            which.extend([i] * ql)
        idx = torch.frombuffer(tok, dtype=torch.long)
        cpu = torch.device("cpu")
        if isinstance(bt, torch.Tensor):
            tables = bt.index_select(0, torch.frombuffer(which, dtype=torch.long)).to(torch.int64)
        else:
            tables = self.cache.table_tensor([bt[i] for i in which], lens, cpu)
        try:
            batch = DecodeBatch(tables, torch.frombuffer(lens, dtype=torch.long),
                                self.slot_mapping.index_select(0, idx), self.cache.block_size,
                                self.cache.num_blocks)
        except ValueError:
            return None
        return batch, (None if len(tok) == tokens else idx)

    def _decode(self, key: int, p: Any, q: torch.Tensor, sdev: torch.device, cdev: torch.device, causal: bool,
                scale: float, window: int | None, softcap: float | None, bias_fn: BiasFn | None) -> torch.Tensor:
        """One attention call for all decode rows; q: [Bd, H, D] -> [Bd, H, D]."""
        if bias_fn is None:
            out = self._decode_kernel(key, p, q, scale, window, softcap)
            if out is not None:
                return out
        self._dec_base(p)
        start = p.memo.get("dec_run")
        kv = None if start is None else self.cache.read_run(key, start, p.lmax)
        if kv is not None:  # the same values and strides as the gather's, read in place
            k, v = kv[0][None], kv[1][None]
        else:
            k, v = self.cache.gather_idx(key, self._dec(p, "dec_idx", sdev))
        k, v = k.transpose(1, 2), v.transpose(1, 2)   # [Bd, Hkv, Lmax, D]
        mask = self._dec(p, "dec_mask", cdev) if p.ragged else None
        if mask is not None and window is None and bias_fn is None and softcap is None:
            # SDPA turns a bool mask into a float bias in every layer: build that bias once per forward instead
            mask = self._on(p, ("dec_bias", q.dtype), cdev, lambda: torch.zeros(
                mask.shape, dtype=q.dtype, device=mask.device).masked_fill_(~mask, float("-inf")))
        if window is not None:  # keys with q_pos - k_pos < window only
            memo = p.memo
            mask = self._on(p, ("dec_win", window), cdev, lambda: memo[("dec_mask", None)] & (
                memo[("dec_kpos", None)][None, :] > memo[("dec_qpos", None)][:, None] - window))
        bias = None
        if bias_fn is not None:  # one query index per row: [H, Bd, Lmax] -> [Bd, H, 1, Lmax]
            bias = bias_fn(self._dec(p, "dec_qpos", cdev), self._dec(p, "dec_kpos", cdev)).transpose(0, 1)[:, :, None, :]
        o = attention_core(q[:, :, None, :], k, v, q_start=0, causal=False, scale=scale, softcap=softcap, bias=bias,
                           key_mask=mask)
        return o[:, :, 0, :]

    def _decode_kernel(self, key: int, p: Any, q: torch.Tensor, scale: float, window: int | None,
                       softcap: float | None) -> torch.Tensor | None:
        """The decode rows through the Triton paged kernel, K/V read in place; None where it does not apply (another
        device, host-resident K/V, Triton missing, an earlier failure of the kernel)."""
        kv = self.cache
        store = kv._dev[key]
        if not _kernel["ok"] or q.device.type not in KERNEL_DEVICES or store.device != q.device:
            return None  # narrower float tiles widen to q's dtype in the kernel; int8 ones come with their scales
        from . import triton_attention

        if not triton_attention.available(q.device):
            return None
        tables = self.block_tables
        rows = (tables if p.pure else tables.index_select(0, torch.tensor(p.dec, device=tables.device))) \
            if isinstance(tables, torch.Tensor) else [tables[i] for i in p.dec]
        lens = [p.ctx.k_lens[i] for i in p.dec]
        # table width a multiple of 16: one stride specialization of the kernel for every step
        tab = self._on(p, "dec_table", q.device, lambda: kv.table_tensor(rows, lens, torch.device("cpu"), 16))
        cnt = self._on(p, "dec_lens", q.device, lambda: torch.tensor(lens))
        try:
            ks, vs = kv.scale_stores(key) or (None, None)
            return triton_attention.paged_decode(q, store.k, store.v, tab, cnt, scale=scale, max_len=p.lmax,
                                                 softcap=softcap, window=window, k_scales=ks, v_scales=vs)
        except Exception as e:  # noqa: BLE001 - a compiler or driver problem: the gather path from now on
            _kernel["ok"] = False
            why = f"{type(e).__name__}: {e}"
            if e.__cause__ is not None:  # Triton's CompilationError keeps the compiler's message here
                why += f" (from {type(e.__cause__).__name__}: {e.__cause__})"
            warnings.warn(f"paged decode kernel failed in a mixed step ({why}); decode rows use a gather and SDPA "
                          f"from now on", RuntimeWarning, stacklevel=2)
            return None
