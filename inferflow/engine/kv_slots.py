"""Block tables -> slots: the index arithmetic of the paged KV cache (a mixin of
:class:`~inferflow.engine.kv_cache.PagedKVCache`, which owns ``block_size`` and ``device``).

A token's *slot* is ``block * block_size + offset`` in the flattened ``[num_blocks * block_size, Hkv, D]`` view
of a layer's K/V; writes take packed slots (``slot_mapping``), reads padded ``[B, Lmax]`` slot indices
(``slot_index``) or one sequence's (``seq_index``); ``run_start`` finds a sequence whose blocks are consecutive
(read as one view, without a gather).
"""
from __future__ import annotations

from array import array
from typing import Sequence

import torch

from ..errors import InferflowError


class SlotIndexing:
    block_size: int
    device: torch.device

    def slot_index(self, tables: Sequence[Sequence[int]] | torch.Tensor, lengths: Sequence[int],
                   device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded slot indices [B, Lmax] (padding points at slot 0) and the key mask [B, Lmax] (True = real).

        ``tables``: lists of block ids, or a padded [B, max_blocks] LongTensor (an engine may keep one
        up to date incrementally, saving the per-step conversion of every block id). Only that table
        crosses from Python; the [B, Lmax] expansion runs on ``device``.
        """
        device = device or self.device
        bs = self.block_size
        table = self.table_tensor(tables, lengths, device)
        lens = torch.tensor(list(lengths), dtype=torch.long).to(device)
        pos = torch.arange(max(lengths), device=device)
        idx = table.index_select(1, pos // bs) * bs + pos % bs
        mask = pos[None, :] < lens[:, None]
        return idx.masked_fill_(~mask, 0), mask

    def table_tensor(self, tables: Sequence[Sequence[int]] | torch.Tensor, lengths: Sequence[int],
                     device: torch.device | None = None, multiple: int = 1) -> torch.Tensor:
        """Block tables as one padded int64 [B, W] tensor on ``device`` (padding: block 0; W a multiple of
        ``multiple``), each table checked to hold its sequence's ``lengths`` keys; one host->device copy."""
        device = device or self.device
        if isinstance(tables, torch.Tensor):
            return tables.to(device)
        bs = self.block_size
        width = max(1, max((len(t) for t in tables), default=1))
        width = -(-width // multiple) * multiple
        for t, n in zip(tables, lengths):
            if n > len(t) * bs:
                raise InferflowError(f"kv cache: length {n} exceeds the {len(t)} block(s) of its table")
        flat, pad = array("q"), array("q", bytes(8 * width))
        for t in tables:
            flat.extend(t)
            if len(t) < width:
                flat.extend(pad[:width - len(t)])
        return torch.frombuffer(flat, dtype=torch.long).view(len(tables), width).to(device)

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
