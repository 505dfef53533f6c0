"""Block bookkeeping for the paged KV cache: allocation, reference counts and the prefix cache.

A block holds ``block_size`` tokens of K/V for every layer. A full block may be registered under the
chained hash of all tokens up to its end (``hash_blocks``); when no request references it any more it
stays "cached" (still holding its K/V, evictable) on an LRU list, so a later request with the same
prefix reuses it (``match_prefix``) instead of recomputing. Allocation takes never-hashed free blocks
first and evicts the least recently released cached block only when those run out.

The pool only does bookkeeping on Python ints; the tensors live in ``PagedKVCache``.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict, deque
from typing import Iterable, Sequence

from ..errors import InferflowError


class NoFreeBlocks(InferflowError):
    """More blocks were asked for than are free or evictable."""


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _token_bytes(tokens: Sequence[int]) -> bytes:
    a = array("q", tokens)
    if sys.byteorder == "big":  # hash the same bytes on every platform
        a.byteswap()
    return a.tobytes()


def hash_blocks(token_ids: Sequence[int], block_size: int, extra: tuple = (), *, prev: int | None = None) -> list[int]:
    """Chained 64-bit hashes of every FULL block of ``token_ids``: h_i = H(h_{i-1}, tokens of block i).

    ``extra`` (model id, cache salt, encoder-input hash: anything with a deterministic ``repr``) is
    mixed into the first block so different models/salts/encoder inputs never share blocks. ``prev``
    continues a chain (``token_ids`` then start at a block boundary after the block hashed as ``prev``;
    ``extra`` is already inside ``prev`` and is ignored), so newly filled blocks are hashed without
    rehashing the prompt. hashlib-based: the same in every process, unlike ``hash()``.
    """
    out: list[int] = []
    head = (b"P" + prev.to_bytes(8, "little")) if prev is not None else (b"X" + repr(tuple(extra)).encode())
    n = len(token_ids) // block_size * block_size
    data, step = _token_bytes(token_ids[:n]), block_size * 8  # one conversion, then byte slices per block
    for start in range(0, n * 8, step):
        h = _digest(head + data[start:start + step])
        out.append(h)
        head = b"P" + h.to_bytes(8, "little")
    return out


class BlockPool:
    """Reference-counted block ids with an LRU prefix cache.

    States of a block: *free* (refcount 0, no hash), *used* (refcount > 0, hashed or not) and *cached*
    (refcount 0 with a hash, on the LRU list, allocatable by eviction).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 0 or block_size < 1:
            raise InferflowError(f"block pool: num_blocks={num_blocks}, block_size={block_size}; expected >= 0 and >= 1")
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()   # cached blocks, oldest release first
        self._hash_of: dict[int, int] = {}                   # block -> hash
        self._block_of: dict[int, int] = {}                  # hash -> block
        self._used = 0
        self.hits = 0      # prefix blocks found by match_prefix
        self.queries = 0   # prefix blocks asked for by match_prefix

    # ---- counts ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks allocatable now: free plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self._used

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def refcount(self, block: int) -> int:
        return self._ref[block]

    def block_hash(self, block: int) -> int | None:
        return self._hash_of.get(block)

    # ---- allocation -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with refcount 1: free ones first, then LRU-evicted cached ones."""
        if n > self.num_free:
            raise NoFreeBlocks(f"kv cache: {n} block(s) needed, {self.num_free} free of {self.num_blocks}")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self._lru.popitem(last=False)
                del self._block_of[self._hash_of.pop(b)]
            self._ref[b] = 1
            out.append(b)
        self._used += n
        return out

    def incref(self, blocks: Iterable[int]) -> None:
        """Share blocks (forked sequences, beams): each needs one more ``release``."""
        for b in blocks:
            r = self._ref[b]
            if r == 0:
                if b not in self._lru:
                    raise InferflowError(f"block pool: incref of free block {b}")
                del self._lru[b]
                self._used += 1
            self._ref[b] = r + 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block, walking the list in REVERSE.

        Pass a request's block table in order: its last block then reaches the LRU tail first, so it is
        evicted before the shared-prefix blocks in front of it. At refcount 0 a hashed block becomes
        cached (LRU tail); an unhashed one is free again.
        """
        for b in reversed(blocks):
            r = self._ref[b]
            if r <= 0:
                raise InferflowError(f"block pool: release of unreferenced block {b}")
            self._ref[b] = r - 1
            if r == 1:
                self._used -= 1
                if b in self._hash_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    # ---- prefix cache ---------------------------------------------------------------------------
    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest run of leading ``hashes`` held in the cache, each incref'd for the caller."""
        self.queries += len(hashes)
        if not self.enable_caching:
            return []
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        self.incref(out)
        self.hits += len(out)
        return out

    def cache_block(self, block: int, h: int) -> None:
        """Register a just-filled, referenced block under hash ``h``; a hash held already keeps its first block."""
        if not self.enable_caching or h in self._block_of or block in self._hash_of:
            return
        if self._ref[block] <= 0:
            raise InferflowError(f"block pool: cache_block of unreferenced block {block}")
        self._hash_of[block], self._block_of[h] = h, block

    def reset_cache(self) -> int:
        """Forget every cached (unreferenced) block, e.g. after weights change; returns how many."""
        n = len(self._lru)
        for b in self._lru:
            del self._block_of[self._hash_of.pop(b)]
            self._free.append(b)
        self._lru.clear()
        return n

    def assert_clean(self) -> None:
        """No leaks: every block is free or cached with refcount 0."""
        leaked = [(b, r) for b, r in enumerate(self._ref) if r]
        if leaked or self._used or len(self._free) + len(self._lru) != self.num_blocks:
            shown = ", ".join(f"{b} (refcount {r})" for b, r in leaked[:16])
            raise AssertionError(f"kv cache leak: {len(leaked)} block(s) still referenced: {shown}; "
                                 f"{len(self._free)} free + {len(self._lru)} cached of {self.num_blocks}")
