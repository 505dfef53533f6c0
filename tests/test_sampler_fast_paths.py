"""The sampler's host-overhead shortcuts pick exactly what the general path picks: the all-greedy argmax fast path
(padded vocabulary columns, EOS bypass) and the all-rows-random path (no row gather/scatter) against the same rows
sampled inside a mixed batch (seeded rows draw independently of the batch)."""
import torch

from inferflow.engine.sampler import Sampler, SeqSampling
from inferflow.engine.sampling_params import SamplingParams


def _seqs(params, n):
    return [SeqSampling.create(p, [3, 4, 5], index=i) for i, p in enumerate([params] * n)]


def test_greedy_fast_path_equals_processed_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    logits[:, 35:] += 10.0          # padding columns (vocab 35) would win if not masked
    logits[0, 2] = 50.0             # EOS wins row 0: bypassed once
    s = Sampler(35, {2})
    seqs = _seqs(SamplingParams(temperature=0.0, eos_bypass_max=1), 6)
    want = s.process(logits.float(), seqs).argmax(-1).tolist()
    got = s(logits, seqs).tokens
    assert all(t < 35 for t in got) and got[1:] == want[1:]
    assert got[0] != 2 and want[0] == 2 and seqs[0].eos_bypassed == 1
    # a processor on one row leaves the fast path; the plain rows still pick the same tokens
    mixed = _seqs(SamplingParams(temperature=0.0), 6)
    mixed[3] = SeqSampling.create(SamplingParams(temperature=0.0, logit_bias={7: 100.0}), [3, 4, 5])
    out = s(logits, mixed).tokens
    assert out[3] == 7 and [t for i, t in enumerate(out) if i != 3] == [t for i, t in enumerate(want) if i != 3]


def test_all_random_rows_equal_the_same_rows_in_a_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    p = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=123)
    alone = Sampler(50, {2})(logits, _seqs(p, 4)).tokens
    greedy = SeqSampling.create(SamplingParams(temperature=0.0), [3, 4, 5])
    mixed = Sampler(50, {2})(torch.cat([logits, logits[:1]]), _seqs(p, 4) + [greedy]).tokens
    assert mixed[:4] == alone and mixed[4] == int(logits[0].argmax())
