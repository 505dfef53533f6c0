"""Pieces of OpenAI response objects: ids, usage, and logprobs in the chat and completions shapes."""
from __future__ import annotations

import time
import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def new_logprobs(output: Any, n_new: int) -> list[dict[int, float]]:
    """The logprob entries of the ``n_new`` newest tokens (the engine's list may be cumulative or a delta)."""
    lp = output.logprobs or []
    if n_new <= 0:
        return []
    return list(lp[-n_new:]) if len(lp) >= n_new else list(lp)


class TokenText:
    """Token id -> the text OpenAI reports for it (decoded alone, special tokens kept), cached."""

    def __init__(self, tokenizer: Any):
        self.tok, self.cache = tokenizer, {}

    def __call__(self, idx: int) -> str:
        s = self.cache.get(idx)
        if s is None:
            s = self.tok.decode([idx], skip_special_tokens=False) if self.tok is not None else str(idx)
            self.cache[idx] = s
        return s


def _ranked(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]], top: int, text: TokenText) -> dict:
    """``{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}`` for the given tokens."""
    content = []
    for tok, entry in zip(token_ids, entries):
        s = text(tok)
        content.append({"token": s, "logprob": max(entry.get(tok, float("-inf")), -9999.0),
                        "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": text(t), "logprob": max(lp, -9999.0),
                                          "bytes": list(text(t).encode("utf-8"))} for t, lp in _ranked(entry, top)]})
    return {"content": content}


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float]], top: int, text: TokenText,
                        offset: int) -> dict:
    """``{tokens, token_logprobs, top_logprobs, text_offset}`` (the legacy completions shape)."""
    tokens, lps, tops, offsets = [], [], [], []
    for tok, entry in zip(token_ids, entries):
        s = text(tok)
        tokens.append(s)
        lps.append(max(entry.get(tok, float("-inf")), -9999.0))
        tops.append({text(t): max(lp, -9999.0) for t, lp in _ranked(entry, top)} if top else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}
