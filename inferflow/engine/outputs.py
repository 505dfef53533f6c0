"""What the engine hands back per step and per request: completions (with deltas for streaming) and embeddings."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's ``n`` sequences: everything so far plus what is new since the previous output.

    ``finish_reason``: "stop" (EOS, a stop token id or a stop string), "length" (max_tokens or the model
    length), "abort" (cancelled) or "error"; ``stop_reason`` is the stop string or stop token id that ended
    it (None for EOS). EOS and stop token ids are not part of ``token_ids``; the text never contains a stop
    string unless ``include_stop_str_in_output``. ``logprobs``: per output token ``{token_id: logprob}`` of
    the chosen token and its top alternatives, when requested.
    """

    index: int
    text: str
    token_ids: list[int]
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's state after one engine step (or its final result when ``finished``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0          # prompt tokens whose KV came from the prefix cache
    error: str | None = None            # why the request failed (finish_reason "error")
    prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """A pooled sentence embedding computed by an encoder batch."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: torch.Tensor | None      # [hidden] float32
    finished: bool = True
    error: str | None = None
