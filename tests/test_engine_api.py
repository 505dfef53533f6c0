"""Engine behaviour seen by callers: n > 1 sharing blocks, streaming deltas, seeded sampling independent of the
batch, logprobs, embeddings through encoder batches, the background thread, async handles and metrics."""
import asyncio
import threading

import pytest
import torch

import engine_models
from engine_models import one_thread  # noqa: F401 - autouse fixture
import inferflow
from inferflow.engine import Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return engine_models.llama(tmp_path_factory.mktemp("llama"))


def _engine(m, **cfg):
    return Engine(m, EngineConfig(**{"block_size": 4, "num_blocks": 128, "max_num_batched_tokens": 64, **cfg}))


def test_n2_shares_prompt_blocks_and_matches_single_requests(model):
    eng = _engine(model)
    prompt = list(range(10, 20))   # 10 tokens: 2 full blocks shared, the partial third copied on write
    h = eng.add_request(prompt, SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=8, ignore_eos=True))
    eng.step()
    req = eng._requests[h.request_id]
    a, b = req.seqs
    assert a.block_table[:2] == b.block_table[:2] and a.block_table[2] != b.block_table[2]
    assert all(eng.cache.pool.refcount(x) == 2 for x in a.block_table[:2])
    res = h.result()
    assert [o.index for o in res.outputs] == [0, 1] and all(len(o.token_ids) == 8 for o in res.outputs)
    # sequence i draws from seed + i: the same tokens as single requests seeded that way
    for i, out in enumerate(res.outputs):
        alone = eng.generate([prompt], SamplingParams(temperature=0.9, seed=5 + i, max_tokens=8, ignore_eos=True))
        assert alone[0].outputs[0].token_ids == out.token_ids
    greedy = eng.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=6))[0]
    assert len({tuple(o.token_ids) for o in greedy.outputs}) == 1
    assert greedy.outputs[0].token_ids == model.generate_ids(prompt, max_new_tokens=6)
    eng.cache.pool.assert_clean()


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = _engine(model).generate([[5, 6, 7]], p)[0].outputs[0].token_ids
    others, _ = engine_models.mix(7, seed=3)
    for cfg in ({}, {"max_num_batched_tokens": 8}):
        eng = _engine(model, **cfg)
        mixed = [SamplingParams(temperature=0.7, max_tokens=6), SamplingParams(temperature=1.3, seed=9, max_tokens=4)]
        hs = [eng.add_request(q, mixed[i % 2]) for i, q in enumerate(others[:3])]
        h = eng.add_request([5, 6, 7], p)
        hs += [eng.add_request(q, mixed[i % 2]) for i, q in enumerate(others[3:])]
        assert h.result().outputs[0].token_ids == alone
        for x in hs:
            x.result()


def test_streaming_deltas_and_logprobs(model):
    eng = _engine(model)
    h = eng.add_request("Hi there", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2))
    text, toks, outs = "", [], list(h)
    for o in outs:
        text += o.outputs[0].delta_text
        toks += o.outputs[0].delta_token_ids
    final = outs[-1]
    assert final.finished and not any(o.finished for o in outs[:-1]) and len(outs) == 10
    assert text == final.outputs[0].text and toks == final.outputs[0].token_ids
    assert final.prompt == "Hi there" and final.prompt_token_ids == engine_models.CharTokenizer().encode("Hi there")
    lps = final.outputs[0].logprobs
    assert len(lps) == 10 and all(len(d) == 2 and t in d for d, t in zip(lps, toks))  # greedy: chosen is top-1
    ref = torch.log_softmax(model.logits(final.prompt_token_ids + toks[:1])[-1], -1)
    assert abs(lps[1][toks[1]] - ref[toks[1]].item()) < 1e-4


def test_background_thread_and_async_handles(model):
    eng = _engine(model)
    prompts, outs = engine_models.mix(6, seed=4)
    want = [model.generate_ids(p, max_new_tokens=k) for p, k in zip(prompts, outs)]
    eng.start()
    try:
        got = [None] * 6

        def worker(i):
            got[i] = eng.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=outs[i])).result()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()

        async def consume(i):
            h = eng.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=outs[i]))
            toks = []
            async for o in h:
                toks += o.outputs[0].delta_token_ids
            return toks

        async def main():
            return await asyncio.gather(*(consume(i) for i in range(3, 6)))

        async_out = asyncio.run(main())
        for t in threads:
            t.join()
        assert [g.outputs[0].token_ids for g in got[:3]] == want[:3] and async_out == want[3:]
        vec = eng.embed([[5, 6, 7], [8, 9]])   # a decoder-only model embeds too (the spec's pooling)
        assert vec.shape == (2, 32)
    finally:
        eng.shutdown()
    eng.cache.pool.assert_clean()

    async def no_thread():  # without the thread, async iteration runs steps off the loop
        return [o async for o in eng.add_request([5, 6], SamplingParams(temperature=0, max_tokens=3))]

    assert asyncio.run(no_thread())[-1].outputs[0].token_ids == model.generate_ids([5, 6], max_new_tokens=3)


def test_embeddings_through_the_engine_equal_model_embed(tmp_path):
    m = engine_models.bert(tmp_path)
    texts = ["hello world", "a", "the quick brown fox", "embeddings!", "x y z"] * 3
    eng = Engine(m, EngineConfig(max_num_batched_tokens=40, max_num_seqs=4))
    ours = eng.embed(texts)
    ref = m.embed(texts)
    assert ours.shape == ref.shape == (15, 32)
    assert torch.allclose(ours, ref, atol=1e-5)
    assert eng.metrics()["embedding_requests"] == 15 and eng.metrics()["steps"] >= 4  # several encoder batches
    res = eng.generate(["hello"], SamplingParams(max_tokens=2))[0]
    assert res.outputs[0].finish_reason == "error" and "embed" in res.error


def test_metrics_and_prometheus(model):
    eng = _engine(model)
    eng.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    m = eng.metrics()
    for key in ("running", "waiting", "swapped", "preemptions", "kv_blocks_used", "kv_blocks_free", "kv_blocks_cached",
                "prefix_cache_hit_rate", "prompt_tokens", "computed_prefill_tokens", "generation_tokens", "steps",
                "step_time_seconds_total"):
        assert key in m
    assert m["prompt_tokens"] == 4 and m["generation_tokens"] == 4 and m["steps"] == 4
    assert m["kv_blocks_used"] == 0 and m["kv_blocks_cached"] == 1 and m["kv_blocks_free"] == 128
    text = eng.metrics_text(labels={"model": "tiny"})
    assert '# TYPE inferflow_generation_tokens_total counter\ninferflow_generation_tokens_total{model="tiny"} 4' in text
    assert '# TYPE inferflow_kv_blocks_used gauge' in text
    assert inferflow.Engine is Engine
