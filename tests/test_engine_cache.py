"""Engine KV management end to end: prefix caching, preemption (recompute and swap), no leaks, overload."""
import pytest
import torch

import engine_models
from engine_models import one_thread  # noqa: F401 - autouse fixture
from inferflow.engine import Engine, EngineConfig, Overloaded, SamplingParams
from inferflow.errors import InferflowError


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return engine_models.llama(tmp_path_factory.mktemp("llama"))


def _engine(m, **cfg):
    return Engine(m, EngineConfig(**{"block_size": 4, "num_blocks": 256, "max_num_batched_tokens": 64, **cfg}))


def _ids(results):
    return [r.outputs[0].token_ids for r in results]


def test_prefix_cache_computes_shared_prompt_once(model):
    system = torch.randint(3, 96, (32,), generator=torch.Generator().manual_seed(6)).tolist()  # 8 blocks of 4
    suffixes, _ = engine_models.mix(8, seed=7, max_prompt=6)
    prompts = [system + s for s in suffixes]
    params = SamplingParams(temperature=0, max_tokens=6)

    eng = _engine(model)
    first = eng.generate(prompts[:1], params)           # computes (and caches) the system prompt
    rest = eng.generate(prompts[1:], params)             # find it in the cache
    m = eng.metrics()
    assert m["computed_prefill_tokens"] == len(system) + sum(map(len, suffixes))
    assert all(r.num_cached_tokens == len(system) for r in rest) and first[0].num_cached_tokens == 0
    assert m["cached_prompt_tokens"] == 7 * len(system)
    assert 0 < m["prefix_cache_hit_rate"] <= 1
    eng.cache.pool.assert_clean()

    plain = _engine(model, enable_prefix_caching=False)
    ref = plain.generate(prompts, params)
    assert plain.metrics()["computed_prefill_tokens"] == sum(map(len, prompts))
    assert _ids(first + rest) == _ids(ref)
    # the cached block holding a prompt's last token is never reused: its logits must be computed
    again = eng.generate([prompts[0]], params)[0]
    assert again.num_cached_tokens == 4 * ((len(prompts[0]) - 1) // 4)
    assert again.outputs[0].token_ids == ref[0].outputs[0].token_ids


def test_cache_salt_and_model_key_separate_prefixes(model):
    eng = _engine(model)
    p = list(range(3, 23))
    eng.generate([p], SamplingParams(temperature=0, max_tokens=2))
    h = eng.add_request(p, SamplingParams(temperature=0, max_tokens=2), cache_salt="tenant-b")
    assert h.result().num_cached_tokens == 0
    h = eng.add_request(p, SamplingParams(temperature=0, max_tokens=2))
    assert h.result().num_cached_tokens == 16


@pytest.mark.parametrize("mode,host_blocks", [("recompute", None), ("swap", 64), ("swap", 2)])
def test_preemption_gives_unconstrained_outputs(model, mode, host_blocks):
    prompts, outs = engine_models.mix(16, seed=9, max_prompt=14, max_out=14)
    params = [SamplingParams(temperature=0, max_tokens=k, n=1 + (i % 5 == 0)) for i, k in enumerate(outs)]
    every = lambda results: [[o.token_ids for o in r.outputs] for r in results]  # noqa: E731
    want = every(_engine(model).generate(prompts, params))
    eng = _engine(model, num_blocks=12, preemption_mode=mode, num_host_blocks=host_blocks,
                  enable_prefix_caching=False)
    got = eng.generate(prompts, params)
    assert every(got) == want and [len(r.outputs) for r in got] == [p.n for p in params]
    m = eng.metrics()
    assert m["preemptions"] > 0
    if mode == "swap":
        assert m["swap_outs"] > 0
        if host_blocks == 2:  # host tier too small for some victims: those fall back to recompute
            assert m["swap_outs"] < m["preemptions"] and m["recomputed_tokens"] > 0
    else:
        assert m["recomputed_tokens"] > 0 and m["swap_outs"] == 0
    eng.cache.pool.assert_clean()
    eng.cache.host_pool.assert_clean()


def test_no_leak_after_stop_string_cancel_and_errors(model):
    eng = _engine(model, num_blocks=64)
    base = eng.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert len(base.token_ids) == 12 and len(base.text) >= 8  # EOS (id 2) decodes to nothing
    stop = base.text[4:6]
    res = eng.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert res.finish_reason == "stop" and res.stop_reason == stop
    assert res.text == base.text[:base.text.index(stop)] and stop not in res.text
    inc = eng.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True,
                                                           include_stop_str_in_output=True))[0].outputs[0]
    assert inc.text == base.text[:base.text.index(stop) + len(stop)]
    eng.cache.pool.assert_clean()

    h = eng.add_request(list(range(3, 40)), SamplingParams(temperature=0, max_tokens=50))
    other = eng.add_request([4, 5, 6], SamplingParams(temperature=0, max_tokens=3))
    eng.step()
    eng.step()
    h.cancel()
    final = h.result()
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert other.result().outputs[0].finish_reason in ("length", "stop")
    eng.cache.pool.assert_clean()

    too_long = eng.add_request(list(range(3, 90)) * 2, SamplingParams(max_tokens=2))
    bad_id = eng.add_request([5, 500], SamplingParams(max_tokens=2))
    ok = eng.add_request([5, 6], SamplingParams(temperature=0, max_tokens=2))
    r = too_long.result()
    assert r.outputs[0].finish_reason == "error" and "max_model_len = 128" in r.error
    assert bad_id.result().outputs[0].finish_reason == "error" and "vocabulary" in bad_id.result().error
    assert ok.result().outputs[0].finish_reason == "length"

    # a failing forward pass fails that batch's requests, not the engine
    real = eng.runner.run
    eng.runner.run = lambda scheduled: (_ for _ in ()).throw(RuntimeError("device lost"))
    hs = [eng.add_request([7, 8, 9, i + 3], SamplingParams(max_tokens=3)) for i in range(3)]
    eng.step()
    eng.runner.run = real
    assert all(h.result().outputs[0].finish_reason == "error" and "device lost" in h.result().error for h in hs)
    assert eng.generate([[7, 8, 9]], SamplingParams(temperature=0, max_tokens=3))[0].error is None
    eng.cache.pool.assert_clean()
    assert not eng.has_unfinished()
    m = eng.metrics()
    assert m["requests_failed"] == 5 and m["requests_aborted"] == 1 and m["kv_blocks_used"] == 0


def test_overloaded(model):
    eng = _engine(model, max_waiting=2)
    a = eng.add_request([5, 6], SamplingParams(max_tokens=2))
    eng.add_request([5, 7], SamplingParams(max_tokens=2))
    with pytest.raises(Overloaded, match=r"overloaded.*max_waiting = 2"):
        eng.add_request([5, 8], SamplingParams(max_tokens=2))
    assert isinstance(Overloaded("x"), InferflowError)
    assert eng.metrics()["requests_rejected"] == 1
    eng.step()  # both admitted: the queue has room again
    eng.add_request([5, 8], SamplingParams(max_tokens=2))
    with pytest.raises(InferflowError, match="already in use"):
        eng.add_request([5], request_id=a.request_id)
    # generate() paces itself instead of failing when it has more prompts than the queue holds
    res = eng.generate([[5, i + 3] for i in range(6)], SamplingParams(temperature=0, max_tokens=2))
    assert len(res) == 6 and all(r.finished for r in res)
    while eng.has_unfinished():
        eng.step()
    eng.cache.pool.assert_clean()


@pytest.mark.parametrize("cfg", [{"host_kv_layers": 0.5}, {"host_kv_layers": 1.0, "host_kv_compute": True},
                                 {"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp8"}])
def test_kv_placement_and_dtype(model, cfg):
    prompts, outs = engine_models.mix(8, seed=11)
    params = [SamplingParams(temperature=0, max_tokens=k) for k in outs]
    want = _ids(_engine(model).generate(prompts, params))
    eng = _engine(model, **cfg)
    got = _ids(eng.generate(prompts, params))
    if "host_kv_layers" in cfg:  # host-resident layers change where K/V live, not the numbers
        assert got == want and eng.cache.host_layers
    else:  # 8-bit K/V: a close approximation; the first tokens come from the unquantised prefill
        assert sum(g[:1] == w[:1] for g, w in zip(got, want)) >= 7
    eng.cache.pool.assert_clean()


@pytest.mark.parametrize("cfg", [{}, {"async_scheduling": True, "graph_prefill_tokens": 16}])
def test_dropped_engine_frees_its_kv_cache_with_the_collector_frozen(model, cfg):
    """A process can make and drop engines (a notebook, a benchmark of configs): a dropped engine frees its KV
    cache at once by reference counting. The decode-graph capture calls gc.freeze(), after which the cycle
    collector never looks at any object made so far, so a reference cycle through the engine would keep its cache
    for the life of the process."""
    import gc
    import weakref

    eng = _engine(model, **cfg)
    eng.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=4, use_beam_search=True, beam_width=2))
    eng.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    stores = [s for s in eng.cache._dev.values()]
    tensors = [weakref.ref(t) for s in stores for t in (getattr(s, k) for k in s.__slots__) if isinstance(t, torch.Tensor)]
    assert tensors
    gone = weakref.ref(eng)
    gc.collect()
    gc.freeze()
    try:
        del eng, stores
        assert gone() is None
        assert all(t() is None for t in tensors)
    finally:
        gc.unfreeze()
