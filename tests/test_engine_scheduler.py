"""Scheduling decisions on the real block pool and KV cache, without a model: token budget and chunked prefill,
decodes first, prefix-cache admission, preemption order, swap out/in and its recompute fallback."""
import pytest

from inferflow.engine.config import EngineConfig
from inferflow.engine.kv_cache import KVLayer, PagedKVCache
from inferflow.engine.request import Request, RequestStatus, Sequence
from inferflow.engine.sampling_params import SamplingParams
from inferflow.engine.scheduler import Scheduler

BS = 4


def _sched(num_blocks=32, host=0, **cfg):
    config = EngineConfig(**{"block_size": BS, "max_num_batched_tokens": 16, "max_num_seqs": 8, **cfg})
    cache = PagedKVCache([KVLayer(0, 1, 2)], num_blocks, BS, num_host_blocks=host,
                         enable_caching=config.enable_prefix_caching)
    return Scheduler(config, cache)


def _seq(prompt, n=1):
    req = Request(f"r{id(prompt)}", list(prompt), SamplingParams(n=n))
    seq = Sequence(req, 0, None)
    req.seqs.append(seq)
    return seq


def _run(s, tokens=None):
    """One schedule + commit; every sequence that reached its last token gets a sampled token appended."""
    out = s.schedule()
    s.commit(out)
    for sc in out.scheduled:
        if sc.samples:
            sc.seq.sampled_before = True
            sc.seq.output_ids.append(tokens or 7)
    return out


def test_budget_chunks_prefill_and_decodes_go_first():
    s = _sched()
    a, b, c = _seq(range(10)), _seq(range(30, 40)), _seq(range(50, 62))
    for q in (a, b, c):
        s.add(q)
    out = _run(s)
    assert [(sc.seq, sc.start, sc.num_tokens) for sc in out.scheduled] == [(a, 0, 10), (b, 0, 6)]
    assert list(s.waiting) == [c] and len(a.block_table) == 3 and len(b.block_table) == 2
    out = s.schedule()  # a decodes first, then b's second chunk, then c starts with what is left of the budget
    assert [(sc.seq, sc.start, sc.num_tokens) for sc in out.scheduled] == [(a, 10, 1), (b, 6, 4), (c, 0, 11)]
    assert [sc.samples for sc in out.scheduled] == [True, True, False]
    s.commit(out)
    a.output_ids.append(7)
    b.output_ids.append(7)
    out = _run(s)
    assert [(sc.seq, sc.start, sc.num_tokens) for sc in out.scheduled] == [(a, 11, 1), (b, 10, 1), (c, 11, 1)]


def test_max_num_seqs_and_n_seats():
    s = _sched(max_num_seqs=3)
    a, b = _seq(range(2), n=2), _seq(range(2), n=2)
    s.add(a)
    s.add(b)
    out = _run(s)
    assert [sc.seq for sc in out.scheduled] == [a]  # b needs 2 more seats than the 3 - 2 reserved for a's n


def test_prefix_admission_skips_the_last_token_block():
    s = _sched()
    first = _seq(range(12))
    s.add(first)
    _run(s)
    assert s.pool.num_used == 3
    s.free(first)
    assert s.pool.num_cached == 3
    same = _seq(range(12))               # 12 tokens: blocks 0-1 reusable, block 2 holds the last token
    longer = _seq(list(range(12)) + [50])
    s.add(same)
    s.add(longer)
    out = _run(s)
    assert [(sc.start, sc.num_tokens) for sc in out.scheduled] == [(8, 4), (12, 1)]
    assert same.request.num_cached_tokens == 8 and longer.request.num_cached_tokens == 12
    assert same.block_table[:2] == longer.block_table[:2]
    assert s.pool.refcount(same.block_table[0]) == 2


def test_recompute_preempts_latest_admitted_to_the_front():
    s = _sched(num_blocks=6, max_num_batched_tokens=32)
    a, b, c = _seq(range(8)), _seq(range(8)), _seq(range(3))
    for q in (a, b, c):
        s.add(q)
    _run(s)  # a, b: 2 blocks each, c: 1 block
    assert s.pool.num_free == 1 and [q.status for q in (a, b, c)] == [RequestStatus.RUNNING] * 3
    out = _run(s)  # a and b both need a third block; b takes it back from c, the latest admitted
    assert out.preempted == [c] and list(s.waiting) == [c] and c.status is RequestStatus.PREEMPTED
    assert c.block_table == [] and c.num_computed == 0 and c.output_ids == [7]  # its token is kept
    assert [sc.seq for sc in out.scheduled] == [a, b] and s.num_preemptions == 1
    while s.has_work():  # c returns (re-prefilling prompt + output) once a and b end at 12 tokens
        for sc in _run(s).scheduled:
            if sc.samples and sc.seq.num_tokens >= 12:
                s.free(sc.seq)
    assert c.num_tokens >= 12
    s.pool.assert_clean()


@pytest.mark.parametrize("host", [16, 1])
def test_swap_out_and_back_in(host):
    s = _sched(num_blocks=6, host=host, preemption_mode="swap")
    a, b = _seq(range(8)), _seq(range(8))
    s.add(a)
    s.add(b)
    out = _run(s)
    while not out.preempted:  # both grow until a needs a block only b can give
        out = _run(s)
    victim = out.preempted[0]
    assert victim is b
    if host == 16:
        assert s.swapped == [b] and b.host_blocks and b.num_computed > 0 and s.num_swap_outs == 1
        computed = b.num_computed
        s.free(a)  # room again: b comes back with its computed tokens intact
        out = _run(s)
        assert [sc.seq for sc in out.scheduled] == [b] and out.scheduled[0].start == computed
        assert not s.swapped and not b.host_blocks and s.cache.num_free_host == 16
    else:  # host tier too small: recompute instead
        assert list(s.waiting) == [b] and b.num_computed == 0 and s.num_swap_outs == 0
    s.free(a)
    s.free(b)
    s.pool.assert_clean()
    s.cache.host_pool.assert_clean()


def test_a_sequence_larger_than_the_pool_fails_alone():
    s = _sched(num_blocks=2)
    big = _seq(range(9))
    s.add(big)
    out = s.schedule()
    assert out.failed and out.failed[0][0] is big and "cannot hold" in out.failed[0][1]
    s.pool.assert_clean()


def test_kv_sizing_from_config():
    import math
    from types import SimpleNamespace

    import torch

    from inferflow.engine.sizing import DEFAULT_MAX_MODEL_LEN, build_cache, max_model_len

    attn = [SimpleNamespace(uses_kv_cache=True, cross=False, cache_key=k, hkv=2, d=8) for k in (0, 2, 4, 6)]
    attn.append(SimpleNamespace(uses_kv_cache=True, cross=True, cache_key=7, hkv=2, d=8))  # cross: not paged
    net = SimpleNamespace(decoder=SimpleNamespace(modules=lambda: iter(attn)))
    model = SimpleNamespace(net=net, params={"n_positions": 64}, dtype=torch.bfloat16, device=torch.device("cpu"))
    cfg = EngineConfig(block_size=16, kv_cache_memory=1 / 1024, preemption_mode="swap", swap_space=1 / 2048,
                       host_kv_layers=0.3)
    assert max_model_len(model, cfg) == 64
    assert max_model_len(SimpleNamespace(params={}), cfg) == DEFAULT_MAX_MODEL_LEN
    cache = build_cache(model, cfg, 4096)  # long context: the memory, not the cap, decides
    per_block = 4 * 2 * 2 * 8 * 2 * 16          # layers * K,V * heads * dim * bf16 bytes * tokens
    assert cache.dtype == "bfloat16" and PagedKVCache.bytes_per_block(cache.layers, 16, "bfloat16") == per_block
    assert cache.num_blocks == (1 << 20) // per_block and cache.num_host_blocks == (1 << 19) // per_block
    assert cache.host_layers == frozenset({4, 6})  # ceil(0.3 * 4) = 2: the last two
    capped = build_cache(model, EngineConfig(block_size=16, max_num_seqs=2), 64)
    assert capped.num_blocks == 2 * math.ceil(64 / 16) and capped.num_host_blocks == 0  # recompute: no swap tier
    assert build_cache(model, EngineConfig(num_blocks=7, kv_cache_dtype="int8"), 64).dtype == "int8"
