"""Block copies between and within the paged KV cache's tiers: copy-on-write copies in the device tier, swapping
blocks out to the host tier and back in (preemption by swapping), and the bytes each tier holds. A mixin of
:class:`~inferflow.engine.kv_cache.PagedKVCache`, which owns the stores and pools used here.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..errors import InferflowError
from .block_pool import BlockPool, NoFreeBlocks
from .kv_store import LayerStore, raw


class BlockCopies:
    _dev: dict[int, LayerStore]
    _host: dict[int, LayerStore]
    pool: BlockPool
    host_pool: BlockPool
    host_layers: frozenset[int]

    @staticmethod
    def _copy(dst: LayerStore, dst_ids: Sequence[int], src: LayerStore, src_ids: Sequence[int]) -> None:
        di = torch.tensor(list(dst_ids), dtype=torch.long, device=dst.device)
        si = torch.tensor(list(src_ids), dtype=torch.long, device=src.device)
        for d, s in zip(dst.tensors(), src.tensors()):
            raw(d).index_copy_(0, di, raw(s).index_select(0, si).to(d.device))  # blocking: a swap is read right after

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
