"""Batched equals sequential: 32 requests of mixed prompt and output lengths through the engine (submitted
together, and staggered while it steps) give token-exactly the greedy outputs of each request run alone
through Model.generate_ids, for a dense decoder, a MoE decoder with a sliding window and an encoder-decoder."""
import pytest

import engine_models
from engine_models import one_thread  # noqa: F401 - autouse fixture
from inferflow.engine import Engine, EngineConfig, SamplingParams


def _params(outs):
    return [SamplingParams(temperature=0.0, max_tokens=k) for k in outs]


def _together(m, prompts, outs, **cfg):
    eng = Engine(m, EngineConfig(**{"block_size": 4, "num_blocks": 256, "max_num_batched_tokens": 48, **cfg}))
    res = eng.generate(prompts, _params(outs))
    assert all(r.finished and r.error is None for r in res)
    eng.cache.pool.assert_clean()
    return [r.outputs[0].token_ids for r in res], eng


def _staggered(m, prompts, outs, **cfg):
    """Requests arrive in waves of 1..5 between steps, while earlier ones are mid-prefill or decoding."""
    eng = Engine(m, EngineConfig(**{"block_size": 4, "num_blocks": 256, "max_num_batched_tokens": 40, **cfg}))
    params, handles, i, wave = _params(outs), [], 0, 1
    while i < len(prompts) or eng.has_unfinished():
        for _ in range(wave):
            if i < len(prompts):
                handles.append(eng.add_request(prompts[i], params[i]))
                i += 1
        wave = wave % 5 + 1
        eng.step()
    eng.cache.pool.assert_clean()
    return [h.result().outputs[0].token_ids for h in handles]


@pytest.fixture(scope="module", params=["llama", "mixtral"])
def decoder(request, tmp_path_factory):
    return getattr(engine_models, request.param)(tmp_path_factory.mktemp(request.param))


def test_decoder_batched_equals_sequential(decoder):
    prompts, outs = engine_models.mix(32, seed=1)
    want = [decoder.generate_ids(p, max_new_tokens=k) for p, k in zip(prompts, outs)]
    got, eng = _together(decoder, prompts, outs)
    assert got == want
    m = eng.metrics()
    assert m["steps"] < sum(outs)  # really batched: far fewer steps than tokens
    assert m["computed_prefill_tokens"] == sum(map(len, prompts))
    assert _staggered(decoder, prompts, outs) == want


def test_encoder_decoder_batched_equals_sequential(tmp_path):
    m = engine_models.t5(tmp_path)
    prompts, outs = engine_models.mix(32, seed=2)
    want = [m.generate_ids(p, max_new_tokens=k) for p, k in zip(prompts, outs)]
    got, eng = _together(m, prompts, outs)
    assert got == want
    assert _staggered(m, prompts, outs) == want
    for mode in ("recompute", "swap"):  # preempted requests keep their encoder output
        got, small = _together(m, prompts, outs, num_blocks=12, preemption_mode=mode, num_host_blocks=8)
        assert got == want and small.metrics()["preemptions"] > 0
    # an explicit decoder prompt continues from it, as generate_ids(prompt, encoder_input_ids=...) does
    dec = [0, 7, 9]
    alone = m.generate_ids(dec, encoder_input_ids=prompts[0], max_new_tokens=5)
    res = eng.generate([], None)
    assert res == []
    h = eng.add_request(dec, SamplingParams(temperature=0, max_tokens=5), encoder_prompt=prompts[0])
    assert h.result().outputs[0].token_ids == alone
