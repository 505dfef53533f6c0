"""Beam search in the engine against HF transformers' ``generate(num_beams=k, do_sample=False)`` on the same tiny
random weights: the best n hypotheses token for token, for a decoder-only and an encoder-decoder model, over
length penalties and early-stopping modes; under preemption and a tiny token budget; mixed with other requests;
blocks freed afterwards."""
from pathlib import Path

import pytest
import torch
import transformers

import inferflow
from engine_models import VOCAB, _perturb, one_thread  # noqa: F401 - autouse fixture
from inferflow.engine import Engine, EngineConfig, SamplingParams
from parity import save
from service_helpers import tiny_llama_ref

# (beam_width, length_penalty, early_stopping, max_new_tokens)
CASES = [(3, 1.0, False, 10), (4, 2.0, True, 12), (2, 2.0, False, 8), (4, -1.0, False, 9), (3, 1.5, "never", 10)]


def _prompts(seed: int, lens=(3, 7, 12, 5, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


def _params(k, lp, es, mx, **kw):
    return SamplingParams(use_beam_search=True, beam_width=k, length_penalty=lp, early_stopping=es, max_tokens=mx,
                          **{"n": min(k, 2), **kw})


def _hf(ref, prompt, k, lp, es, mx, eos, skip, **kw) -> list[list[int]]:
    """HF's best min(k, 2) sequences, generated part only, cut before EOS (the engine never outputs EOS)."""
    out = ref.generate(torch.tensor([prompt]), num_beams=k, do_sample=False, length_penalty=lp, early_stopping=es,
                       max_new_tokens=mx, num_return_sequences=min(k, 2), **kw)
    res = []
    for row in out.tolist():
        toks = row[skip:]
        res.append(toks[:toks.index(eos)] if eos in toks else toks)
    return res


def _check(m, ref, prompts, eos, skip, **hf_kw):
    eng = Engine(m, EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=64))
    differ = False
    for k, lp, es, mx in CASES:
        res = eng.generate(prompts, _params(k, lp, es, mx))
        for p, r in zip(prompts, res):
            assert r.error is None and r.finished
            want = _hf(ref, p, k, lp, es, mx, eos, len(p) if skip is None else skip, **hf_kw)
            assert [o.token_ids for o in r.outputs] == want, (k, lp, es, mx, p)
            assert [o.index for o in r.outputs] == list(range(len(want)))
            assert {o.finish_reason for o in r.outputs} <= {"stop", "length"}
            if es is True:  # the case is meaningful: HF's answer depends on early_stopping here
                differ |= _hf(ref, p, k, lp, False, mx, eos, len(p) if skip is None else skip, **hf_kw) != want
        eng.cache.pool.assert_clean()
    assert differ
    return eng


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    ref = tiny_llama_ref(VOCAB, intermediate_size=48)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # peaked distributions, and an EOS (id 2) that wins in some contexts
        ref.lm_head.weight.mul_(8)
        ref.lm_head.weight[2] += 0.5 * torch.randn(32, generator=g)
    m = inferflow.load(save(ref, tmp_path_factory.mktemp("llama")), dtype="float32")
    return m, ref


def test_decoder_only_equals_transformers(llama):
    m, ref = llama
    _check(m, ref, _prompts(1), eos=2, skip=None, pad_token_id=0)


def test_encoder_decoder_equals_transformers(tmp_path):
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                decoder_start_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = _perturb(transformers.T5ForConditionalGeneration(cfg), 0.5)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # EOS (id 1) reachable
        ref.lm_head.weight[1] += 3 * torch.randn(32, generator=g)
    m = inferflow.load(save(ref, tmp_path), dtype="float32")
    # the prompt is the encoder input; the decoder starts from decoder_start_token_id, as HF's does
    _check(m, ref, _prompts(1), eos=1, skip=1)


def test_preemption_budget_and_mixed_batches(llama):
    m, _ = llama
    prompts = _prompts(5, lens=(12, 3, 9, 11, 4, 7, 12, 6))
    params = _params(3, 0.7, False, 10, ignore_eos=True)
    big = Engine(m, EngineConfig(block_size=4, num_blocks=256))
    want = [[o.token_ids for o in r.outputs] for r in big.generate(prompts, params)]
    # pools too small for every beam at once (one holds a single request's beams only one by one), swapping,
    # and a token budget smaller than the beams of one request
    for cfg in (dict(num_blocks=24), dict(num_blocks=24, preemption_mode="swap", num_host_blocks=16),
                dict(num_blocks=7), dict(num_blocks=64, max_num_batched_tokens=2)):
        eng = Engine(m, EngineConfig(block_size=4, **cfg))
        res = eng.generate(prompts, params)
        assert [[o.token_ids for o in r.outputs] for r in res] == want, cfg
        assert eng.metrics()["preemptions"] > 0 or "max_num_batched_tokens" in cfg
        eng.cache.pool.assert_clean()
    # beams next to greedy, sampled and n > 1 requests: each as if alone
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    sampled = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6)
    mixed = [params if i % 3 == 0 else greedy if i % 3 == 1 else sampled for i in range(len(prompts))]
    alone = [[o.token_ids for o in big.generate(p, q)[0].outputs] for p, q in zip(prompts, mixed)]
    eng = Engine(m, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=32))
    assert [[o.token_ids for o in r.outputs] for r in eng.generate(prompts, mixed)] == alone
    eng.cache.pool.assert_clean()


def test_streaming_cancel_and_refusals(llama):
    m, _ = llama
    eng = Engine(m, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4))
    h = eng.add_request([5, 6, 7], _params(3, 1.0, False, 8, ignore_eos=True))
    outs = list(h)
    assert len(outs) == 1 and outs[0].finished  # beams are rewritten every step: only the end is streamed
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in outs[0].outputs)
    h = eng.add_request([5, 6, 7], _params(3, 1.0, False, 8))
    eng.step()
    eng.step()
    h.cancel()
    assert h.result().outputs[0].finish_reason == "abort"
    eng.cache.pool.assert_clean()
    for bad, what in ((_params(2, 1.0, False, 4, n=3), "exceeds beam_width"),
                      (_params(5, 1.0, False, 4), "max_num_seqs"), (_params(2, 1.0, False, 4, stop=["x"]), "stop strings")):
        r = eng.generate([5, 6], bad)[0]
        assert r.outputs[0].finish_reason == "error" and what in r.error
    eng.cache.pool.assert_clean()
