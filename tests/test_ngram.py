"""Prompt lookup (inferflow/engine/ngram.py): the proposal is what followed the latest earlier occurrence of the
longest recurring suffix, as a brute-force search finds it, including ids whose bytes match across token
boundaries (the search runs on the ids' bytes)."""
import random
from array import array

from inferflow.engine.ngram import propose


def _brute(t, k, n_max, n_min):
    for n in range(min(n_max, len(t) - 1), n_min - 1, -1):
        for i in range(len(t) - 1 - n, -1, -1):
            if t[i:i + n] == t[len(t) - n:]:
                return t[i + n:i + n + k]
    return []


def test_examples():
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], 4, 4, 1) == [4, 5, 1, 2]  # "1 2 3" recurs: what followed it
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 3, 1) == [7, 1]  # the latest match wins
    assert propose([5, 6, 7], 3, 4, 1) == []
    assert propose([5, 6, 5], 3, 4, 2) == []  # only a 1-gram recurs
    assert propose([9], 2, 4, 1) == [] and propose([], 2, 4, 1) == []


def test_matches_a_brute_force_search():
    rng = random.Random(0)
    ids = [0, 1, 2, 256, 65536, 65537, 16777216]  # bytes of one id inside another's neighbours
    for _ in range(5000):
        t = [rng.choice(ids[:rng.randint(2, len(ids))]) for _ in range(rng.randint(0, 14))]
        k, n_min = rng.randint(1, 5), rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        assert propose(t, k, n_max, n_min) == _brute(t, k, n_max, n_min), (t, k, n_max, n_min)


def test_lookup_state_follows_the_sequence_and_backs_off():
    """A sequence's kept bytes grow by its new tokens each step (rebuilt if it ever has fewer); after a proposal
    rejected outright it skips 1, 2, 4 .. 8 steps, and an accepted token resets that."""
    from inferflow.engine.ngram import MAX_BACKOFF, Lookup

    toks = [1, 2, 3, 4]

    class Seq:
        num_tokens = property(lambda self: len(toks))

        def tokens(self, a, b):
            return toks[a:b]

    seq, st = Seq(), Lookup()
    for extra in ([1, 2], [3], []):
        toks += extra
        assert st.propose(seq, 2, 3, 1) == _brute(toks, 2, 3, 1)
        assert st.hay == array("i", toks).tobytes()
    del toks[2:]
    st.propose(seq, 2, 3, 1)
    assert st.hay == array("i", toks).tobytes()
    toks[:] = [1, 2, 1, 2, 1]
    skipped = []
    for _ in range(5):
        st.verified(0)
        n = 0
        while st.propose(seq, 2, 3, 1) == []:
            n += 1
        skipped.append(n)
    assert skipped == [1, 2, 4, MAX_BACKOFF, MAX_BACKOFF]
    st.verified(1)
    assert st.propose(seq, 2, 3, 1) == [2, 1]
