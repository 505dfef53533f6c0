import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferflow.engine.block_pool import BlockPool, NoFreeBlocks, hash_blocks
from inferflow.errors import InferflowError


def test_hash_blocks_chained_full_blocks_only():
    h = hash_blocks(list(range(10)), 4)
    assert len(h) == 2 and all(isinstance(x, int) and 0 <= x < 2 ** 64 for x in h)
    assert hash_blocks(list(range(8)), 4) == h                       # the partial tail is not hashed
    assert hash_blocks([0, 1, 2, 3, 9, 9, 9, 9], 4)[0] == h[0]       # block 0 depends on block 0 only
    assert hash_blocks([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != h[1]       # block 1 depends on block 0 (chained)
    assert hash_blocks(list(range(8)), 4, extra=("model", "salt"))[0] != h[0]
    assert hash_blocks(list(range(8)), 4, extra=("model", "salt")) == hash_blocks(list(range(8)), 4, ("model", "salt"))
    assert hash_blocks(list(range(4, 8)), 4, prev=h[0]) == h[1:]     # continuing a chain
    assert hash_blocks([1, 2], 4) == []


def test_hash_blocks_deterministic_across_processes():
    code = "from inferflow.engine.block_pool import hash_blocks; print(hash_blocks(list(range(12)), 4, ('m',)))"
    root = str(Path(__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                           env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": path}).stdout
            for seed in ("1", "2")}
    assert outs == {f"{hash_blocks(list(range(12)), 4, ('m',))}\n"}


def test_allocate_release_refcounts():
    pool = BlockPool(6, 4)
    a = pool.allocate(4)
    assert len(set(a)) == 4 and pool.num_free == 2 and pool.num_used == 4
    assert all(pool.refcount(b) == 1 for b in a)
    pool.incref(a[:2])
    assert pool.refcount(a[0]) == 2
    pool.release(a)
    assert pool.num_used == 2 and pool.num_free == 4 and pool.num_cached == 0
    with pytest.raises(NoFreeBlocks):
        pool.allocate(5)
    assert pool.num_free == 4  # a refused allocation takes nothing
    pool.release(a[:2])
    pool.assert_clean()
    with pytest.raises(InferflowError):
        pool.release(a[:1])   # double free
    with pytest.raises(InferflowError):
        pool.incref([a[0]])   # free (unhashed) blocks cannot be shared


def test_prefix_match_and_hits():
    pool = BlockPool(8, 2)
    hs = hash_blocks([1, 2, 3, 4, 5, 6], 2)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, hs):
        pool.cache_block(b, h)
    pool.release(blocks)
    assert pool.num_cached == 3 and pool.num_used == 0 and pool.num_free == 8
    other = hash_blocks([1, 2, 3, 4, 9, 9], 2)
    got = pool.match_prefix(other)
    assert got == blocks[:2] and all(pool.refcount(b) == 1 for b in got)
    assert pool.num_cached == 1 and pool.hits == 2 and pool.queries == 3
    assert pool.match_prefix(hash_blocks([7, 7], 2)) == []
    pool.release(got)
    pool.assert_clean()
    off = BlockPool(4, 2, enable_caching=False)
    b = off.allocate(1)
    off.cache_block(b[0], hs[0])
    off.release(b)
    assert off.num_cached == 0 and off.match_prefix(hs) == []


def test_lru_eviction_prefers_free_then_oldest_release():
    pool = BlockPool(4, 1)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.cache_block(a[0], 11)
    pool.cache_block(b[0], 22)
    pool.release(a)  # released first: evicted first
    pool.release(b)
    fresh = pool.allocate(2)
    assert set(fresh).isdisjoint(a + b) and pool.num_cached == 2  # never-hashed blocks go before cached ones
    assert pool.allocate(1) == a and pool.match_prefix([11]) == []  # eviction drops the hash
    assert pool.match_prefix([22]) == b                               # still cached
    pool.release(fresh + a + b)
    pool.assert_clean()


def test_reverse_release_evicts_tail_first():
    pool = BlockPool(3, 1)
    table = pool.allocate(3)
    for b, h in zip(table, hash_blocks([5, 6, 7], 1)):
        pool.cache_block(b, h)
    pool.release(table)   # table order in; walks it in reverse
    assert [pool.allocate(1)[0] for _ in range(3)] == table[::-1]


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4, 2)
    x, y = pool.allocate(2)
    pool.cache_block(x, 42)
    pool.cache_block(y, 42)           # same content computed twice: y stays unhashed
    assert pool.block_hash(x) == 42 and pool.block_hash(y) is None
    pool.release([x, y])
    assert pool.num_cached == 1
    assert pool.match_prefix([42]) == [x]
    pool.release([x])
    pool.assert_clean()


def test_shared_cached_block_incref_from_lru():
    pool = BlockPool(2, 1)
    (b,) = pool.allocate(1)
    pool.cache_block(b, 7)
    pool.release([b])
    pool.incref([b])                   # a cached block can be revived directly
    assert pool.num_cached == 0 and pool.num_used == 1
    pool.release([b])
    assert pool.reset_cache() == 1 and pool.match_prefix([7]) == []
    pool.assert_clean()


def test_assert_clean_detects_leaks():
    pool = BlockPool(3, 4)
    a = pool.allocate(2)
    pool.release(a[:1])
    with pytest.raises(AssertionError, match="1 block"):
        pool.assert_clean()
    pool.release(a[1:])
    pool.assert_clean()


def test_no_free_blocks_is_inferflow_error():
    pool = BlockPool(0, 4)
    assert pool.allocate(0) == []
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    assert issubclass(NoFreeBlocks, InferflowError)
