"""The paged KV cache: per-layer K/V block tensors, a device tier, host-resident layers and a swap tier.

Layout per layer: K and V ``[num_blocks, block_size, Hkv, D]``, addressed through a flattened
``[num_blocks * block_size, Hkv, D]`` view by *slot* = block * block_size + offset. Writes are one
``index_copy_``, reads one ``index_select`` of precomputed slot indices (see ``slot_index``).

Storage dtypes (float32/float16/bfloat16 as is, or ``int8`` with per-token-per-head scales) and one layer's
tensors: kv_store.py. Slot arithmetic: kv_slots.py. Block copies and swapping between tiers: kv_swap.py.

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

from typing import Sequence

import torch

from ..errors import InferflowError
from .block_pool import BlockPool, NoFreeBlocks  # noqa: F401 - NoFreeBlocks: re-exported (swap_in raises it)
from .kv_slots import SlotIndexing
from ..model.hugepages import Arena
from .kv_store import KVLayer, LayerStore, quantize_int8, raw, storage_dtype
from .kv_store import kv_layers  # noqa: F401 - re-exported: its home was this module
from .kv_swap import BlockCopies

_CPU = torch.device("cpu")


class PagedKVCache(SlotIndexing, BlockCopies):
    """K/V block tensors for every KV layer, addressed by slot (block * block_size + offset).

    ``host_layers`` holds ``KVLayer.key`` values; ``enable_caching`` switches the device pool's prefix cache.
    """

    def __init__(self, layers: Sequence[KVLayer], num_blocks: int, block_size: int, *, dtype: str = "float32",
                 compute_dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 num_host_blocks: int = 0, host_layers: frozenset[int] = frozenset(), host_compute: bool = False,
                 enable_caching: bool = True, cpu_layers: frozenset[int] = frozenset()):
        sd = storage_dtype(dtype)
        self.layers = list(layers)
        self.block_size, self.num_blocks, self.num_host_blocks = block_size, num_blocks, num_host_blocks
        self.dtype, self.store_dtype, self.compute_dtype = dtype, sd, compute_dtype
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
        self._dev: dict[int, LayerStore] = {}
        self._host: dict[int, LayerStore] = {}
        self._claimed: tuple | None = None  # (key, slots, k) of a write a kernel did itself (claim_write)
        # unpinned CPU stores (a CPU model's cache) share one huge-page arena: attention streams them as it does
        # the weights (model/hugepages.py); its pages are faulted in now, not during the first requests
        cpu = [layer for layer in self.layers if (self.device.type == "cpu" or layer.key in self.host_layers)
               and not (pin and layer.key in self.host_layers)]
        cpu_keys = {layer.key for layer in cpu}
        shapes = [sh for layer in cpu for sh in LayerStore.shapes(layer, num_blocks, block_size, sd)]
        arena = Arena.for_shapes(shapes, populate=True) if cpu else None
        for layer in self.layers:
            on_host = layer.key in self.host_layers
            self._dev[layer.key] = LayerStore.new(layer, num_blocks, block_size, self.store_dtype,
                                                  _CPU if on_host else self.device, pin and on_host,
                                                  arena if layer.key in cpu_keys else None)
            if num_host_blocks:
                self._host[layer.key] = LayerStore.new(layer, num_host_blocks, block_size, self.store_dtype, _CPU, pin)

    @staticmethod
    def bytes_per_block(layers: Sequence[KVLayer], block_size: int, dtype: str) -> int:
        """Bytes one block takes over all layers (K + V, plus the int8 scales)."""
        elem = torch.empty(0, dtype=storage_dtype(dtype)).element_size()
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

    # ---- write / read ---------------------------------------------------------------------------
    def claim_write(self, key: int, slots: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``key``'s flat K/V stores [S, Hkv, D] for a kernel that stores ``k`` (and its v) at ``slots`` itself
        (model/fused_qk_rope.py; an int8 cache's row scales come from ``scale_stores``); the next ``write`` of these
        very tensors is then skipped. None: write as usual (another device)."""
        st = self._dev.get(key)
        if st is None or st.k.device != slots.device or st.k.device != k.device:
            return None
        self._claimed = (key, slots, k)
        return st.k.view(-1, *st.k.shape[2:]), st.v.view(-1, *st.v.shape[2:])

    def scale_stores(self, key: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An int8 layer's K and V row scales as flat [S, Hkv] float32 views (what a kernel that quantizes and reads
        rows itself updates); None for other dtypes."""
        st = self._dev[key]
        if st.ks is None:
            return None
        return st.ks.view(-1, st.ks.shape[2]), st.vs.view(-1, st.vs.shape[2])

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
            ks, vs = self.scale_stores(key)
            if kf.is_cuda:  # quantized and stored in one launch: triton_kv_write.py
                from .triton_kv_write import write_kv_int8

                if write_kv_int8(kf, vf, ks, vs, slots, k, v):
                    return
            (qk, sk), (qv, sv) = quantize_int8(k), quantize_int8(v)
            kf.index_copy_(0, slots, qk)
            vf.index_copy_(0, slots, qv)
            ks.index_copy_(0, slots, sk)
            vs.index_copy_(0, slots, sv)
        else:
            if kf.is_cuda:  # K and V in one launch instead of two index_copy_ (+ casts): triton_kv_write.py
                from .triton_kv_write import write_kv

                if write_kv(kf, vf, slots, k, v):
                    return
            sd = self.store_dtype
            raw(kf).index_copy_(0, slots, raw(k if k.dtype == sd else k.to(sd)))
            raw(vf).index_copy_(0, slots, raw(v if v.dtype == sd else v.to(sd)))

    def gather_idx(self, key: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at slot indices ``idx`` (any shape S): [*S, Hkv, D] in the compute dtype on ``compute_device``.

        ``idx`` should already live on the layer's storage device (``storage_device``) to avoid a copy.
        """
        st = self._dev[key]
        if idx.device != st.device:
            idx = idx.to(st.device)
        flat = idx.reshape(-1)
        hd = st.k.shape[2:]
        k = raw(st.k).view(-1, *hd).index_select(0, flat).view(st.k.dtype)
        v = raw(st.v).view(-1, *hd).index_select(0, flat).view(st.v.dtype)
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
