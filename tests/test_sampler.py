"""The engine's batched sampler, each stage checked against its definition on hand-made logits."""
import math

import pytest
import torch
import transformers

from inferflow.engine.logits_processors import NGramPenalty, apply_processors, validate
from inferflow.engine.sampler import Sampler, SeqSampling, tail_free_filter, typical_filter
from inferflow.engine.sampling_params import SamplingParams as SP
from inferflow.errors import InferflowError

EOS = 9


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny kernels: see conftest.py


def seq(prompt=(1,), output=(), **kw) -> SeqSampling:
    s = SeqSampling.create(SP(max_tokens=None, **kw), list(prompt))
    s.output_ids = list(output)
    return s


def logits_of(probs, V=10, order=None) -> torch.Tensor:
    """A [1, V] row whose softmax puts ``probs`` on the ids in ``order`` (default 0, 1, ...) and ~0 elsewhere."""
    row = torch.full((1, V), -1e4)
    for i, p in zip(order or range(len(probs)), probs):
        row[0, i] = math.log(p)
    return row


def kept(logits, **kw) -> set[int]:
    """Tokens the row's samplers leave a chance (-1e4 logits of logits_of have probability 0 in float32)."""
    s = Sampler(logits.shape[1], {EOS})
    out = s.truncate(logits, [seq(**kw)])
    return set((torch.softmax(out[0], -1) > 0).nonzero()[:, 0].tolist())


P4 = [0.5, 0.3, 0.15, 0.05]
ORDER = [7, 2, 5, 0]  # ids deliberately not in probability order


def test_greedy():
    L = torch.tensor([[0.1, 3.0, 2.9, -1.0], [5.0, 1.0, 0.0, 0.0]])
    s = Sampler(4, {3})
    assert s(L, [seq(temperature=0.0), seq(top_k=1, temperature=2.0)]).tokens == [1, 0]


@pytest.mark.parametrize("top_p, want", [(0.4, {7}), (0.75, {7, 2}), (0.81, {7, 2, 5}), (1.0, {7, 2, 5, 0})])
def test_top_p_smallest_set_with_mass(top_p, want):
    assert kept(logits_of(P4, order=ORDER), top_p=top_p) == want


@pytest.mark.parametrize("min_p, want", [(0.2, {7, 2, 5}), (0.5, {7, 2}), (0.9, {7}), (0.0, {7, 2, 5, 0})])
def test_min_p_relative_to_max(min_p, want):
    assert kept(logits_of(P4, order=ORDER), min_p=min_p) == want


def test_top_k_then_top_p_renormalised():
    L = logits_of(P4, order=ORDER)
    assert kept(L, top_k=3) == {7, 2, 5}
    # without top-k, 0.5 < 0.6 keeps two tokens; after top-k=2 the top token has 0.625 >= 0.6 alone
    assert kept(L, top_p=0.6) == {7, 2}
    assert kept(L, top_k=2, top_p=0.6) == {7}


@pytest.mark.parametrize("typical_p, want", [(0.25, {2}), (0.5, {2, 7}), (0.9, {2, 7, 5}), (0.99, {2, 7, 5, 0})])
def test_typical_by_hand(typical_p, want):
    # H = 1.1421 nats; |-ln p - H| = 0.449, 0.062, 0.755, 1.854: typical order 0.3, 0.5, 0.15, 0.05
    assert kept(logits_of(P4, order=ORDER), typical_p=typical_p) == want


def test_typical_matches_sort_based_reference():
    torch.manual_seed(0)
    L = torch.randn(64, 50) * 3
    for mass in (0.2, 0.5, 0.9, 0.95):
        ref = transformers.TypicalLogitsWarper(mass=mass)(None, L.clone())
        s, order = torch.sort(L, -1, descending=True)
        ours = torch.full_like(s, float("-inf")).scatter(1, order, typical_filter(s, torch.full((64, 1), mass)))
        assert torch.equal(torch.isfinite(ours), torch.isfinite(ref)), mass
    # rows that do not use it pass through unchanged
    s = torch.sort(L, -1, descending=True).values
    assert torch.equal(typical_filter(s, torch.ones(64, 1)), s)


@pytest.mark.parametrize("z, want", [(0.2, {0}), (0.5, {0, 1}), (0.3, {0})])
def test_tail_free_by_hand(z, want):
    # p = .4 .3 .15 .1 .05: |d2| = .05 .10 .00 -> weights 1/3 2/3 0, cumulative 1/3 1 1;
    # token 1 stays iff 1/3 <= z, token 2 needs 1 <= z, the last token always goes
    assert kept(logits_of([0.4, 0.3, 0.15, 0.1, 0.05], V=5), tfs_z=z) == want


def test_tail_free_matches_reference():
    def reference(row, z):  # Bricken's definition over the whole (sorted) vocabulary
        p = torch.softmax(torch.sort(row, descending=True).values, -1)
        d2 = (p[1:] - p[:-1]).diff().abs()
        cdf = (d2 / d2.sum()).cumsum(0)
        remove = torch.cat([torch.tensor([False]), cdf > z, torch.tensor([True])])
        return set(torch.sort(row, descending=True).indices[~remove].tolist())

    torch.manual_seed(1)
    L = torch.randn(32, 40) * 2
    for z in (0.3, 0.7, 0.95):
        s, order = torch.sort(L, -1, descending=True)
        out = torch.full_like(s, float("-inf")).scatter(1, order, tail_free_filter(s, torch.full((32, 1), z)))
        for b in range(32):
            assert set(torch.isfinite(out[b]).nonzero()[:, 0].tolist()) == reference(L[b], z), (z, b)


def chi_square(tokens, expected, n):
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected)).double()
    assert counts[expected == 0].sum() == 0, "sampled a token the filters removed"
    e = expected[expected > 0].double() * n
    return float(((counts[expected > 0] - e) ** 2 / e).sum()), int((expected > 0).sum()) - 1


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # 99.9% quantiles


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=1.5, top_p=0.8), dict(min_p=0.1, top_k=4),
                                dict(temperature=1.3, typical_p=0.9)])
def test_sampled_frequencies_follow_filtered_distribution(kw):
    L = torch.tensor([[1.0, 0.0, -1.0, 0.5, 2.0, -3.0]])
    n = 4000
    s = Sampler(6, {EOS}, generator=torch.Generator().manual_seed(123))
    seqs = [seq(**kw) for _ in range(n)]
    tokens = s(L.expand(n, -1).contiguous(), seqs).tokens
    expected = torch.softmax(s.truncate(L, seqs[:1])[0], -1)
    stat, df = chi_square(tokens, expected, n)
    assert stat < CHI2_999[df], (stat, df)


def test_seeded_rows_sample_the_same_distribution():
    L = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    n = 2000
    seqs = [seq(temperature=0.8, seed=1000 + i) for i in range(n)]
    tokens = Sampler(4, {EOS})(L.expand(n, -1).contiguous(), seqs).tokens
    stat, df = chi_square(tokens, torch.softmax(L[0] / 0.8, -1), n)
    assert stat < CHI2_999[df]


def fake_model(V=48):
    torch.manual_seed(7)
    W = torch.randn(V, V) * 2.5
    return lambda s: W[(s.prompt_ids + s.output_ids)[-1]] + 0.05 * len(s.output_ids)


def run(sampler, model, batch: list[SeqSampling], steps: int) -> None:
    for _ in range(steps):
        out = sampler(torch.stack([model(s) for s in batch]), batch)
        for s, t in zip(batch, out.tokens):
            s.output_ids.append(t)


def test_seeded_sequence_independent_of_batch():
    V, steps = 48, 40
    model = fake_model(V)
    want = dict(temperature=0.9, top_p=0.95, top_k=30, seed=42, presence_penalty=0.3)
    alone = seq(prompt=[3], **want)
    run(Sampler(V, {EOS}), model, [alone], steps)
    others = [dict(), dict(temperature=0.0), dict(mirostat=2, seed=1), dict(fsd_alpha=0.5), dict(typical_p=0.8),
              dict(tfs_z=0.9, min_p=0.05), dict(seed=42, temperature=1.2)]
    for pos, extra in ((0, others[:3]), (2, others[3:]), (4, others)):
        batch = [seq(prompt=[1 + i], **kw) for i, kw in enumerate(extra)]
        mine = seq(prompt=[3], **want)
        batch.insert(min(pos, len(batch)), mine)
        run(Sampler(V, {EOS}, generator=torch.Generator().manual_seed(pos)), model, batch, steps)
        assert mine.output_ids == alone.output_ids
    other_seed = seq(prompt=[3], **{**want, "seed": 43})
    run(Sampler(V, {EOS}), model, [other_seed], steps)
    assert other_seed.output_ids != alone.output_ids


def test_batch_rows_equal_rows_alone():
    torch.manual_seed(3)
    L = torch.randn(6, 30) * 2
    kws = [dict(top_k=5), dict(top_p=0.7), dict(min_p=0.2, temperature=0.5), dict(typical_p=0.6), dict(tfs_z=0.8),
           dict(top_k=10, top_p=0.9, min_p=0.05, typical_p=0.9, tfs_z=0.95)]
    s = Sampler(30, {EOS})
    together = s.truncate(L, [seq(**kw) for kw in kws])
    for b, kw in enumerate(kws):
        assert torch.equal(together[b], s.truncate(L[b:b + 1], [seq(**kw)])[0])


def test_mirostat_truncation_and_mu_update():
    # surprises -log2 p = 1, 2, 3, 3 bits; mu starts at 2 * tau = 2.2: keeps tokens 0 and 1 (renormalised 2/3, 1/3)
    L = logits_of([0.5, 0.25, 0.125, 0.125], V=4)
    s = seq(mirostat=2, mirostat_tau=1.1, mirostat_eta=0.1, seed=0)
    assert kept(L, mirostat=2, mirostat_tau=1.1) == {0, 1}
    sampler = Sampler(4, {EOS})
    seen = set()
    for _ in range(30):
        mu = s.mirostat_mu if s.mirostat_mu is not None else 2.2
        keep = {i for i, bits in enumerate([1, 2, 3, 3]) if bits <= mu} or {0}
        t = sampler(L, [s]).tokens[0]
        assert t in keep
        p = torch.tensor([0.5, 0.25, 0.125, 0.125])[sorted(keep)]
        p_t = float(p[sorted(keep).index(t)] / p.sum())
        assert s.mirostat_mu == pytest.approx(mu - 0.1 * (-math.log2(p_t) - 1.1), abs=1e-5)
        seen.add(t)
    assert seen == {0, 1}  # mu stays between 2 and 3 bits: both kept tokens get drawn


def test_ngram_penalty_by_hand():
    ng = NGramPenalty(3, 0.9)
    ng.sync([1, 2, 3], [1, 2])
    # after (1, 2): {3: 1} -> 0.9 * 1/2; after (2,): {3: 1} -> 0.1 * 0.9 * 1/2; unigrams 1/5 -> 0.01 * 0.2
    assert ng.penalties([3, 4, 1]) == pytest.approx([0.45 + 0.045 + 0.002, 0.0, 0.4])
    ng.sync([1, 2, 3], [1, 2, 9])  # incremental == rebuilt
    fresh = NGramPenalty(3, 0.9)
    fresh.sync([1, 2, 3, 1, 2, 9], [])
    assert ng.penalties([3, 9, 1]) == fresh.penalties([3, 9, 1])


def test_fsd_prefers_the_less_repetitive_candidate():
    L = logits_of([0.4, 0.35, 0.25], V=10, order=[3, 4, 5])
    s = Sampler(10, {EOS})
    assert s(L, [seq(prompt=[1, 2, 3], output=[1, 2], fsd_alpha=0.5)]).tokens == [4]      # 3 would repeat "1 2 3"
    assert s(L, [seq(prompt=[1, 2, 3], output=[1, 2], fsd_alpha=0.05)]).tokens == [3]     # small alpha: p wins
    assert s(L, [seq(prompt=[7, 8, 6], output=[1, 2], fsd_alpha=0.5)]).tokens == [3]      # nothing to repeat


def test_penalties_exact_values():
    L = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    hist = [([0], [1])]
    out = apply_processors(L, [SP(repetition_penalty=2.0)], hist, {EOS})
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0, 1.0]]
    out = apply_processors(L, [SP(presence_penalty=0.5, frequency_penalty=0.25)], [([2, 3], [2, 2, 3])], {EOS})
    assert out.tolist() == [[2.0, -1.0, 0.5 - 1.0, 3.0 - 0.75, 1.0]]  # prompt occurrences do not count
    out = apply_processors(L, [SP(logit_bias={3: -10, 1: 2.5})], hist, {EOS})
    assert out.tolist() == [[2.0, 1.5, 0.5, -7.0, 1.0]]
    out = apply_processors(L, [SP(allowed_token_ids=[1, 2])], hist, {EOS})
    assert torch.isneginf(out[0, [0, 3, 4]]).all() and out[0, 1:3].tolist() == [-1.0, 0.5]
    # a batch: each row gets only its own edits
    out = apply_processors(L.expand(2, -1), [SP(repetition_penalty=2.0), SP()], hist * 2, {EOS})
    assert out[1].tolist() == L[0].tolist()


def test_min_tokens_and_ignore_eos():
    L = torch.tensor([[0.0, 0.0, 0.0, 5.0, 4.0]])
    s = Sampler(5, {3})
    greedy = dict(temperature=0.0, stop_token_ids=[4], min_tokens=2)
    assert s(L, [seq(output=[0], **greedy)]).tokens == [0]        # EOS 3 and stop id 4 masked
    assert s(L, [seq(output=[0, 1], **greedy)]).tokens == [3]     # min_tokens reached
    # ignore_eos: EOS is an ordinary token (the engine does not stop on it), min_tokens leaves it alone
    assert s(L, [seq(output=[0], ignore_eos=True, **greedy)]).tokens == [3]
    assert s(L, [seq(ignore_eos=True, temperature=0.0)]).tokens == [3]
    # processors that leave no token at all fall back to the raw logits rather than choosing blindly
    assert s(L, [seq(allowed_token_ids=[3], min_tokens=1, temperature=0.0)]).tokens == [3]


def test_eos_bypassing():
    L = torch.tensor([[1.0, 2.0, 0.5, 3.0]])  # EOS (3) is the best token
    s = Sampler(4, {3})
    g = seq(temperature=0.0, eos_bypass_max=2)
    assert [s(L, [g]).tokens[0] for _ in range(3)] == [1, 1, 3] and g.eos_bypassed == 2
    only_eos = seq(top_p=0.01, eos_bypass_max=2, seed=0)  # EOS is the only candidate: nothing to bypass with
    assert s(L, [only_eos]).tokens == [3] and only_eos.eos_bypassed == 0
    top2 = seq(top_k=2, eos_bypass_max=100, seed=0)  # whatever it draws, never EOS, and the best other candidate
    assert {s(L, [top2]).tokens[0] for _ in range(50)} == {1}
    assert 0 < top2.eos_bypassed < 50
    fsd = seq(fsd_alpha=0.5, eos_bypass_max=1)
    assert s(L, [fsd]).tokens == [1] and s(L, [fsd]).tokens == [3]


def test_logprobs_from_raw_logits():
    L = torch.tensor([[1.0, 2.0, 0.5, 3.0], [0.0, 0.0, 1.0, 0.0]])
    out = Sampler(4, {EOS})(L, [seq(temperature=0.0, logprobs=2, logit_bias={0: 10.0}), seq(logprobs=0, seed=1)])
    raw = torch.log_softmax(L, -1)
    assert out.tokens[0] == 0  # the bias changed the choice, not the reported logprobs
    assert out.logprobs[0] == pytest.approx(float(raw[0, 0]))
    assert out.logprobs[1] == pytest.approx(float(raw[1, out.tokens[1]]))
    assert [t for t, _ in out.top_logprobs[0]] == [3, 1]
    assert [v for _, v in out.top_logprobs[0]] == pytest.approx(raw[0, [3, 1]].tolist())
    assert out.top_logprobs[1] == []
    assert Sampler(4, {EOS})(L, [seq(), seq()]).logprobs is None


def test_padded_vocab_never_sampled_and_validation():
    L = torch.zeros(1, 8)
    L[0, 6:] = 50.0  # padded embedding rows with large logits
    s = Sampler(6, {EOS})
    assert s(L, [seq(temperature=0.0)]).tokens[0] < 6
    assert all(t < 6 for t in s(L.expand(64, -1), [seq() for _ in range(64)]).tokens)
    with pytest.raises(InferflowError, match="allowed_token_ids"):
        validate(SP(allowed_token_ids=[3, 99]), 10)
    with pytest.raises(InferflowError, match="logit_bias"):
        validate(SP(logit_bias={-1: 1.0}), 10)
    validate(SP(logit_bias={3: 1.0}, stop_token_ids=[9]), 10)
