"""Prompt-lookup (n-gram) proposals for speculative decoding without a draft model (``speculative_model =
"[ngram]"``, vLLM's name; llama.cpp's lookup decoding, HF's ``prompt_lookup_num_tokens``): the tokens that followed
the latest earlier occurrence of the sequence's last n tokens, for n from ``ngram_prompt_lookup_max`` down to
``ngram_prompt_lookup_min``. They cost no model pass; the target verifies them as it verifies a draft model's.
It pays where outputs repeat their context: summaries and quotes, code edits, extraction, structured text."""
from __future__ import annotations

from array import array
from typing import Any, Sequence

NGRAM = "[ngram]"  # the speculative_model value that selects this proposer


def propose(tokens: Sequence[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier match of the last n tokens (longest n first); [] when
    no n-gram of ``n_min`` or more tokens recurs."""
    return propose_bytes(array("i", tokens).tobytes(), k, n_max, n_min)


MAX_BACKOFF = 8  # steps a sequence skips the lookup at most, after proposals wholly rejected in a row


class Lookup:
    """A sequence's lookup state (``Sequence.lookup``): its tokens as int32 bytes, extended by the tokens added
    since the last step (a step costs the new tokens, not the whole context), and a backoff: a proposal the target
    rejects outright costs a verification of k + 1 rows for one token, so after one the sequence skips the lookup
    for 1, 2, 4 .. MAX_BACKOFF steps; an accepted token resets it."""

    __slots__ = ("hay", "skip", "backoff")

    def __init__(self):
        self.hay, self.skip, self.backoff = bytearray(), 0, 0

    def propose(self, seq: Any, k: int, n_max: int, n_min: int) -> list[int]:
        """:func:`propose` for ``seq`` (its tokens ``seq.tokens(a, b)``, ``seq.num_tokens``), or [] while it backs
        off."""
        if self.skip:
            self.skip -= 1
            return []
        hay, n = self.hay, seq.num_tokens
        if len(hay) > 4 * n:  # fewer tokens than kept (never expected): rebuilt
            del hay[:]
        if len(hay) < 4 * n:
            hay += array("i", seq.tokens(len(hay) // 4, n)).tobytes()
        return propose_bytes(hay, k, n_max, n_min)

    def verified(self, accepted: int) -> None:
        """The target accepted ``accepted`` of the last proposal."""
        self.backoff = 0 if accepted else min(MAX_BACKOFF, 2 * self.backoff or 1)
        self.skip = self.backoff


def propose_bytes(hay: bytes | bytearray, k: int, n_max: int, n_min: int) -> list[int]:
    """:func:`propose` on the tokens' int32 bytes (one C-level ``rfind`` per n)."""
    count = len(hay) // 4
    if k < 1 or count < n_min + 1:
        return []
    for n in range(min(n_max, count - 1), n_min - 1, -1):
        needle = hay[4 * (count - n):]
        end = 4 * (count - 1)  # a match ends before the last token, so at least one token follows it
        pos = hay.rfind(needle, 0, end)
        while pos > 0 and pos % 4:  # a match across token boundaries: look before it
            pos = hay.rfind(needle, 0, pos + len(needle) - 1)
        if pos >= 0:
            i = pos // 4 + n
            return array("i", hay[4 * i:4 * min(i + k, count)]).tolist()
    return []
