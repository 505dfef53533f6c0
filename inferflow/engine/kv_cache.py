"""The paged KV cache: per-layer K/V block tensors, a device tier, host-resident layers and a swap tier.

Layout per layer: K and V ``[num_blocks, block_size, Hkv, D]``, addressed through a flattened
``[num_blocks * block_size, Hkv, D]`` view by *slot* = block * block_size + offset. Writes are one
``index_copy_``, reads one ``index_select`` of precomputed slot indices (see ``slot_index``).

Storage dtypes: float32/float16/bfloat16 store K/V as is (converted on write and on gather). ``int8``
stores symmetric per-token-per-head absmax quantised values ``q = round(x * 127 / absmax(x[token, head]))``
plus one float32 scale per token and head, dequantised to the compute dtype on gather. True cost:
8 + 32 / head_dim bits per element (8.25 for D = 128), i.e. ``2 * Hkv * (D + 4)`` bytes per token per
layer against ``2 * Hkv * D * 2`` for float16. float32 scales avoid float16's subnormal range for small K/V.
int8 is a capacity feature (twice the tokens of float16): PyTorch's int8 -> float conversion is slow
on GPU, so a step over int8 blocks takes longer than over float16 ones (~0.9 vs ~0.2 ms per layer for
64 x 1k tokens on an H200) until a fused dequantising kernel replaces the gather.

Tiers:
- device tier: ``num_blocks`` blocks, bookkept by ``self.pool`` (a prefix-caching ``BlockPool``).
  Layers whose key is in ``host_layers`` (Inferflow's "last N% of layers' KV in host memory") keep
  their device-tier blocks in host RAM under the same block ids: writes copy the new K/V to the host,
  gathers copy the gathered K/V back to the compute device, or, with ``host_compute``, attention for
  those layers runs on the CPU (``compute_device(key)``) and only q and the output cross.
- host tier: ``num_host_blocks`` blocks for every layer in host memory (pinned under CUDA) with its own
  non-caching ``self.host_pool``, used by ``swap_out``/``swap_in`` (preemption by swapping).
On a CPU-only machine every tier is host memory, but the same separate tensors, accounting and copies run.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..errors import InferflowError
from .block_pool import BlockPool, NoFreeBlocks

_STORE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}
_CPU = torch.device("cpu")


@dataclass(slots=True)
class KVLayer:
    key: int            # the attention module's cache_key (Model numbers them)
    num_kv_heads: int
    head_dim: int


def kv_layers(model: Any) -> list[KVLayer]:
    """The decoder self-attention layers of a ``Model`` (cross-attention keeps its K/V per request)."""
    dec = getattr(model.net, "decoder", None)
    if dec is None:
        return []
    return [KVLayer(m.cache_key, m.hkv, m.d) for m in dec.modules()
            if getattr(m, "uses_kv_cache", False) and not getattr(m, "cross", False)]


@dataclass(slots=True)
class _Store:
    """One layer's K/V [blocks, block_size, Hkv, D] (and int8 scales [blocks, block_size, Hkv]) in one tier."""

    k: torch.Tensor
    v: torch.Tensor
    ks: torch.Tensor | None
    vs: torch.Tensor | None

    @classmethod
    def new(cls, layer: KVLayer, nb: int, bs: int, dtype: torch.dtype, device: torch.device, pin: bool) -> "_Store":
        # zeros, not empty: padded gathers read slots they then mask, and 0 * NaN garbage would be NaN
        def z(*shape, dt=dtype):
            return torch.zeros(shape, dtype=dt, device=device, pin_memory=pin)

        shape = (nb, bs, layer.num_kv_heads, layer.head_dim)
        q8 = dtype == torch.int8
        return cls(z(*shape), z(*shape), z(*shape[:3], dt=torch.float32) if q8 else None,
                   z(*shape[:3], dt=torch.float32) if q8 else None)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.ks, self.vs) if t is not None]

    @property
    def device(self) -> torch.device:
        return self.k.device


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, H, D] -> int8 values and float32 scales [N, H] (symmetric absmax per token and head)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.round(xf / scale[..., None]).clamp_(-127, 127).to(torch.int8), scale


class PagedKVCache:
    """K/V block tensors for every KV layer, addressed by slot (block * block_size + offset).

    ``host_layers`` holds ``KVLayer.key`` values; ``enable_caching`` switches the device pool's prefix cache.
    """

    def __init__(self, layers: Sequence[KVLayer], num_blocks: int, block_size: int, *, dtype: str = "float32",
                 compute_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 num_host_blocks: int = 0, host_layers: frozenset[int] = frozenset(), host_compute: bool = False,
                 enable_caching: bool = True, cpu_layers: frozenset[int] = frozenset()):
        if dtype not in _STORE:
            raise InferflowError(f"kv cache: dtype {dtype!r}; expected one of {', '.join(_STORE)}")
        self.layers = list(layers)
        self.block_size, self.num_blocks, self.num_host_blocks = block_size, num_blocks, num_host_blocks
        self.dtype, self.store_dtype, self.compute_dtype = dtype, _STORE[dtype], compute_dtype
        self.device = torch.device(device)
        self.quantized = dtype == "int8"
        keys = {layer.key for layer in self.layers}
        # ``cpu_layers`` (the CPU/GPU hybrid placement): layers computed on the CPU keep their K/V in host memory
        # and attend there, whatever ``host_compute`` says for the other host layers
        self.cpu_layers = frozenset(cpu_layers)
        host_layers = frozenset(host_layers) | self.cpu_layers
        unknown = set(host_layers) - keys
        if unknown:
            raise InferflowError(f"kv cache: host_layers {sorted(unknown)} are not KV layer keys {sorted(keys)}")
        self.host_layers, self.host_compute = frozenset(host_layers), host_compute
        pin = self.device.type == "cuda"
        self.pool = BlockPool(num_blocks, block_size, enable_caching)
        self.host_pool = BlockPool(num_host_blocks, block_size, enable_caching=False)
        self._dev: dict[int, _Store] = {}
        self._host: dict[int, _Store] = {}
        self._claimed: tuple | None = None  # (key, slots, k) of a write a kernel did itself (claim_write)
        for layer in self.layers:
            on_host = layer.key in self.host_layers
            self._dev[layer.key] = _Store.new(layer, num_blocks, block_size, self.store_dtype,
                                              _CPU if on_host else self.device, pin and on_host)
            if num_host_blocks:
                self._host[layer.key] = _Store.new(layer, num_host_blocks, block_size, self.store_dtype, _CPU, pin)

    @staticmethod
    def bytes_per_block(layers: Sequence[KVLayer], block_size: int, dtype: str) -> int:
        """Bytes one block takes over all layers (K + V, plus the int8 scales)."""
        if dtype not in _STORE:
            raise InferflowError(f"kv cache: dtype {dtype!r}; expected one of {', '.join(_STORE)}")
        elem = torch.empty(0, dtype=_STORE[dtype]).element_size()
        per_token = sum(2 * layer.num_kv_heads * (layer.head_dim * elem + (4 if dtype == "int8" else 0))
                        for layer in layers)
        return per_token * block_size

    @property
    def num_free_host(self) -> int:
        return self.host_pool.num_free

    def has_layer(self, key: int) -> bool:
        return key in self._dev

    def compute_device(self, key: int) -> torch.device:
        """Where attention over this layer's keys runs: the CPU for host layers under ``host_compute``."""
        if key in self.cpu_layers:
            return _CPU
        return _CPU if self.host_compute and key in self.host_layers else self.device

    def storage_device(self, key: int) -> torch.device:
        return self._dev[key].device

    # ---- slot indices ---------------------------------------------------------------------------
    def slot_index(self, tables: Sequence[Sequence[int]] | torch.Tensor, lengths: Sequence[int],
                   device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded slot indices [B, Lmax] (padding points at slot 0) and the key mask [B, Lmax] (True = real).

        ``tables``: lists of block ids, or a padded [B, max_blocks] LongTensor (an engine may keep one
        up to date incrementally, saving the per-step conversion of every block id). Only that table
        crosses from Python; the [B, Lmax] expansion runs on ``device``.
        """
        device = device or self.device
        bs = self.block_size
        if isinstance(tables, torch.Tensor):
            table = tables.to(device)
        else:
            width = max(1, max((len(t) for t in tables), default=1))
            for t, n in zip(tables, lengths):
                if n > len(t) * bs:
                    raise InferflowError(f"kv cache: length {n} exceeds the {len(t)} block(s) of its table")
            flat, pad = array("q"), array("q", bytes(8 * width))
            for t in tables:
                flat.extend(t)
                if len(t) < width:
                    flat.extend(pad[:width - len(t)])
            table = torch.frombuffer(flat, dtype=torch.long).view(len(tables), width).to(device)
        lens = torch.tensor(list(lengths), dtype=torch.long).to(device)
        pos = torch.arange(max(lengths), device=device)
        idx = table.index_select(1, pos // bs) * bs + pos % bs
        mask = pos[None, :] < lens[:, None]
        return idx.masked_fill_(~mask, 0), mask

    def slot_mapping(self, tables: Sequence[Sequence[int]], starts: Sequence[int], counts: Sequence[int],
                     device: torch.device | None = None) -> torch.Tensor:
        """Slots [sum(counts)] of tokens ``starts[i] .. starts[i] + counts[i] - 1`` of each sequence, packed.

        Small batches (decode steps) are computed in Python; large ones with a few tensor ops, so Python
        work stays per sequence and per touched block.
        """
        bs, flat, off = self.block_size, [], []
        for table, s, n in zip(tables, starts, counts):
            b0, b1 = s // bs, (s + n - 1) // bs + 1 if n > 0 else s // bs
            if b1 > len(table):
                raise InferflowError(f"kv cache: tokens up to {s + n} exceed the {len(table)} block(s) of their table")
            off.append(len(flat) - b0)     # flat index of this sequence's block 0
            flat.extend(table[b0:b1])
        total = sum(counts)
        if total <= 4 * len(counts) + 64:
            out = torch.tensor([flat[o + p // bs] * bs + p % bs for o, s, n in zip(off, starts, counts)
                                for p in range(s, s + n)], dtype=torch.long)
        else:
            cnt = torch.tensor(list(counts), dtype=torch.long)
            seq = torch.repeat_interleave(torch.arange(len(cnt)), cnt)               # [N] sequence of each token
            pos = (torch.tensor(list(starts), dtype=torch.long) - (torch.cumsum(cnt, 0) - cnt))[seq] + torch.arange(total)
            out = torch.tensor(flat, dtype=torch.long)[torch.tensor(off, dtype=torch.long)[seq] + pos // bs] * bs + pos % bs
        return out.to(device or self.device)

    def seq_index(self, blocks: Sequence[int] | torch.Tensor, length: int,
                  device: torch.device | None = None) -> torch.Tensor:
        """Slot indices [length] of one sequence's first ``length`` tokens."""
        device = device or self.device
        if length > len(blocks) * self.block_size:
            raise InferflowError(f"kv cache: length {length} exceeds the {len(blocks)} block(s) of its table")
        pos = torch.arange(length, device=device)
        table = torch.as_tensor(blocks if isinstance(blocks, torch.Tensor) else list(blocks), dtype=torch.long)
        return table.to(device)[pos // self.block_size] * self.block_size + pos % self.block_size

    # ---- write / read ---------------------------------------------------------------------------
    def claim_write(self, key: int, slots: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``key``'s flat K/V stores [S, Hkv, D] for a kernel that stores ``k`` (and its v) at ``slots`` itself
        (model/fused_qk_rope.py); the next ``write`` of these very tensors is then skipped. None: write as usual
        (quantized stores, another device)."""
        st = self._dev.get(key)
        if st is None or self.quantized or st.k.device != slots.device or st.k.device != k.device:
            return None
        self._claimed = (key, slots, k)
        return st.k.view(-1, *st.k.shape[2:]), st.v.view(-1, *st.v.shape[2:])

    def release_claim(self) -> None:
        """Forget a ``claim_write`` whose kernel did not run: the next ``write`` stores as usual."""
        self._claimed = None

    def write(self, key: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V [N, Hkv, D] at ``slots`` [N] (on any device; moved to the layer's storage)."""
        claimed, self._claimed = self._claimed, None
        if claimed is not None and claimed[0] == key and claimed[1] is slots and claimed[2] is k:
            return  # already stored by the kernel that produced k (claim_write)
        st = self._dev[key]
        if slots.device != st.device:
            slots = slots.to(st.device)
        if k.device != st.device:
            k, v = k.to(st.device), v.to(st.device)
        kf, vf = st.k.view(-1, *st.k.shape[2:]), st.v.view(-1, *st.v.shape[2:])
        if self.quantized:
            (qk, sk), (qv, sv) = _quantize(k), _quantize(v)
            kf.index_copy_(0, slots, qk)
            vf.index_copy_(0, slots, qv)
            st.ks.view(-1, st.ks.shape[2]).index_copy_(0, slots, sk)
            st.vs.view(-1, st.vs.shape[2]).index_copy_(0, slots, sv)
        else:
            if kf.is_cuda:  # K and V in one launch instead of two index_copy_ (+ casts): triton_kv_write.py
                from .triton_kv_write import write_kv

                if write_kv(kf, vf, slots, k, v):
                    return
            sd = self.store_dtype
            kf.index_copy_(0, slots, k if k.dtype == sd else k.to(sd))
            vf.index_copy_(0, slots, v if v.dtype == sd else v.to(sd))

    def gather_idx(self, key: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at slot indices ``idx`` (any shape S): [*S, Hkv, D] in the compute dtype on ``compute_device``.

        ``idx`` should already live on the layer's storage device (``storage_device``) to avoid a copy.
        """
        st = self._dev[key]
        if idx.device != st.device:
            idx = idx.to(st.device)
        flat = idx.reshape(-1)
        hd = st.k.shape[2:]
        k = st.k.view(-1, *hd).index_select(0, flat)
        v = st.v.view(-1, *hd).index_select(0, flat)
        dev = self.compute_device(key)
        if k.device != dev:
            k, v = k.to(dev, non_blocking=True), v.to(dev, non_blocking=True)
        if self.quantized:
            ks = st.ks.view(-1, hd[0]).index_select(0, flat).to(dev, non_blocking=True)
            vs = st.vs.view(-1, hd[0]).index_select(0, flat).to(dev, non_blocking=True)
            # one fused kernel each: int8 * float32 scale, computed in float32, written in the compute dtype
            k = torch.mul(k, ks[..., None], out=torch.empty(k.shape, dtype=self.compute_dtype, device=dev))
            v = torch.mul(v, vs[..., None], out=torch.empty(v.shape, dtype=self.compute_dtype, device=dev))
        elif k.dtype != self.compute_dtype:
            k, v = k.to(self.compute_dtype), v.to(self.compute_dtype)
        return k.view(*idx.shape, *hd), v.view(*idx.shape, *hd)

    @staticmethod
    def run_start(blocks: Sequence[int] | torch.Tensor, length: int, block_size: int) -> int | None:
        """The first slot of a sequence whose first ``length`` tokens lie in consecutive blocks (a fresh pool hands
        a lone sequence such runs), else None. Checked in Python on list tables only (tensors: None)."""
        if isinstance(blocks, torch.Tensor) or length < 1:
            return None
        n = -(-length // block_size)
        if n > len(blocks):
            return None
        b0 = blocks[0]
        return b0 * block_size if blocks[n - 1] - b0 == n - 1 and all(
            blocks[i] == b0 + i for i in range(1, n - 1)) else None

    def read_run(self, key: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K, V [length, Hkv, D] of slots ``start .. start+length-1`` as views of the store (no gather), when the
        store holds them as the compute dtype on the compute device; else None (gather instead)."""
        st = self._dev[key]
        if self.quantized or st.k.dtype != self.compute_dtype or st.device != self.compute_device(key):
            return None
        hd = st.k.shape[2:]
        return st.k.view(-1, *hd)[start:start + length], st.v.view(-1, *hd)[start:start + length]

    def gather(self, key: int, blocks: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's first ``length`` keys and values: [length, Hkv, D] each."""
        return self.gather_idx(key, self.seq_index(blocks, length, self.storage_device(key)))

    def gather_batch(self, key: int, tables: Sequence[Sequence[int]],
                     lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded K, V [B, Hkv, Lmax, D] and key_mask [B, Lmax] (True = real key) for a decode batch."""
        idx, mask = self.slot_index(tables, lengths, self.storage_device(key))
        k, v = self.gather_idx(key, idx)
        return k.transpose(1, 2), v.transpose(1, 2), mask.to(k.device)

    # ---- block copies ---------------------------------------------------------------------------
    @staticmethod
    def _copy(dst: _Store, dst_ids: Sequence[int], src: _Store, src_ids: Sequence[int]) -> None:
        di = torch.tensor(list(dst_ids), dtype=torch.long, device=dst.device)
        si = torch.tensor(list(src_ids), dtype=torch.long, device=src.device)
        for d, s in zip(dst.tensors(), src.tensors()):
            d.index_copy_(0, di, s.index_select(0, si).to(d.device))  # blocking: a swap is read right after

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Device-tier block copies src[i] -> dst[i] in every layer (copy-on-write for forks / beams)."""
        if len(src) != len(dst):
            raise InferflowError(f"kv cache: copy_blocks of {len(src)} source(s) to {len(dst)} destination(s)")
        if src:
            for st in self._dev.values():
                self._copy(st, dst, st, src)

    def swap_out(self, blocks: Sequence[int]) -> list[int]:
        """Copy device blocks (all layers) to newly allocated host-tier blocks; returns the host ids.

        The device blocks stay allocated: the caller releases them from ``self.pool`` (they may be shared).
        Raises NoFreeBlocks (nothing copied) when the host tier is short.
        """
        host = self.host_pool.allocate(len(blocks))
        if blocks:
            for key, st in self._dev.items():
                self._copy(self._host[key], host, st, blocks)
        return host

    def swap_in(self, host_ids: Sequence[int]) -> list[int]:
        """Copy host-tier blocks back into newly allocated device blocks and free the host ids.

        Returns the new device ids (refcount 1, unhashed). Raises NoFreeBlocks (host ids kept) when the
        device tier is short.
        """
        if len(host_ids) > self.pool.num_free:
            raise NoFreeBlocks(f"kv cache: swap in of {len(host_ids)} block(s), {self.pool.num_free} free")
        dev = self.pool.allocate(len(host_ids))
        if host_ids:
            for key, st in self._dev.items():
                self._copy(st, dev, self._host[key], host_ids)
        self.host_pool.release(host_ids)
        return dev

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held per tier (``device`` counts host-resident layers under ``host_layers``)."""
        size = lambda stores: sum(t.numel() * t.element_size() for s in stores for t in s.tensors())  # noqa: E731
        return {"device": size(s for k, s in self._dev.items() if k not in self.host_layers),
                "host_layers": size(s for k, s in self._dev.items() if k in self.host_layers),
                "host_tier": size(self._host.values())}
