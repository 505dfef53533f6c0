"""Incremental detokenization: the text each new token adds, never half a character.

Decoding token by token and concatenating is wrong for every common tokenizer: byte-level BPE and byte-fallback
pieces split multi-byte UTF-8 characters across tokens, and SentencePiece decoders drop the leading space of the
first piece they see. So (as vLLM and TGI do) each step decodes a short window twice: the tokens since
``prefix_offset`` up to ``read_offset`` (already emitted) and the same window plus the new tokens; the new text
is the difference. The window starts a few tokens back (initially in the prompt), so a first output piece
"▁Paris" after a prompt reads " Paris". While the decoded tail ends in U+FFFD (an incomplete UTF-8 sequence)
nothing is emitted and the offsets stay put, so the character comes out whole once its last byte arrives.

Invariant: with ``prompt_ids`` as context, ``decode(prompt) + all deltas == decode(prompt + output)`` (for an
empty prompt: the deltas concatenate to ``decode(output)``), given ``flush()`` at the end.
"""
from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens kept as decoding context (enough for any leading-space / merge decision)


class IncrementalDetokenizer:
    """Feed output tokens one at a time with ``add``; ``text`` holds everything emitted so far."""

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = [int(i) for i in list(prompt_ids)[-CONTEXT_TOKENS:]]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def add(self, token_id: int) -> str:
        """The text ``token_id`` completes ("" while a character is still partial or the token decodes to
        nothing, e.g. a skipped special token)."""
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Whatever is still held back at the end of the sequence (an incomplete UTF-8 tail, as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT) and not final):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        # drop context the window no longer needs, so the token list stays short on long generations
        if self._prefix_offset > 64:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self.text += delta
        return delta
