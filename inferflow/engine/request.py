"""Request and sequence state kept by the engine between steps.

A request owns its prompt, its sampling parameters and (encoder-decoder models) the cross-attention K/V
of its encoder input; it produces ``n`` sequences. The scheduler works on sequences: each has its own
block table, computed-token count, sampler state, detokenizer and stop checker. Before its first token a
request has one sequence; with ``n > 1`` the others are forked from it once the prompt is computed.
"""
from __future__ import annotations

import enum
import itertools
from typing import Any

from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # queued, holds no blocks
    RUNNING = "running"        # admitted: holds device blocks, scheduled every step it fits
    PREEMPTED = "preempted"    # recompute: blocks freed, requeued at the front; swapped: blocks in the host tier
    FINISHED = "finished"


_admissions = itertools.count()


class Sequence:
    """One generated continuation; its tokens are the request's prompt followed by ``output_ids``."""

    __slots__ = ("request", "index", "output_ids", "block_table", "host_blocks", "num_computed", "block_hashes",
                 "num_registered", "sampling", "detok", "stop", "text", "logprobs", "status", "finish_reason",
                 "stop_reason", "admitted", "sent_tokens", "sent_text", "sampled_before", "lookup")

    def __init__(self, request: "Request", index: int, sampling: Any, detok: Any = None, stop: Any = None):
        self.request, self.index = request, index
        self.output_ids: list[int] = []
        self.block_table: list[int] = []
        self.host_blocks: list[int] = []        # host-tier copies while swapped out
        self.num_computed = 0                   # tokens whose K/V is in the blocks
        self.block_hashes: list[int] = []       # chained hashes of the full blocks of the tokens
        self.num_registered = 0                 # leading blocks of block_table offered to the prefix cache
        self.sampling = sampling                # SeqSampling (its output_ids IS self.output_ids)
        self.detok, self.stop = detok, stop     # IncrementalDetokenizer / StopChecker, or None without tokenizer
        self.text = ""
        self.logprobs: list[dict[int, float]] | None = [] if request.params.logprobs is not None else None
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.admitted = -1                      # admission order: the latest admitted is preempted first
        self.sent_tokens = 0                    # output tokens / text characters already streamed
        self.sent_text = 0
        self.sampled_before = False             # the request's first sample forks the n sequences
        self.lookup: Any = None                 # prompt lookup's state (ngram.Lookup), made at first use

    # ---- tokens ---------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions ``start..end-1`` of prompt + output."""
        p, n = self.request.prompt_ids, len(self.request.prompt_ids)
        if end <= n:
            return p[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return p[start:] + self.output_ids[:end - n]

    def full_block_hashes(self, num_blocks: int, block_size: int) -> list[int]:
        """Hashes of the first ``num_blocks`` full blocks, extending the cached chain as tokens arrive."""
        from .block_pool import hash_blocks

        have = len(self.block_hashes)
        if num_blocks > have:
            prev = self.block_hashes[-1] if have else None
            new = hash_blocks(self.tokens(have * block_size, num_blocks * block_size), block_size,
                              self.request.hash_extra, prev=prev)
            self.block_hashes.extend(new)
        return self.block_hashes[:num_blocks]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def admit(self) -> None:
        self.status = RequestStatus.RUNNING
        self.admitted = next(_admissions)


class Request:
    """A submitted prompt with its parameters, sequences and output stream."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *, prompt: str | None = None,
                 encoder_ids: list[int] | None = None, hash_extra: tuple = (), stream: Any = None):
        self.request_id, self.prompt_ids, self.params, self.prompt = request_id, prompt_ids, params, prompt
        self.encoder_ids = encoder_ids          # encoder-decoder models: the encoder input
        self.cross: dict = {}                   # cross-attention K/V per layer key, computed once (first step)
        self.hash_extra = hash_extra            # prefix-cache keys: model id, cache salt, encoder input hash
        self.seqs: list[Sequence] = []
        self.num_cached_tokens = 0
        self.error: str | None = None
        self.stream = stream                    # OutputStream the handles read
        self.aborted = False
        self.beam: Any = None                   # BeamState of a beam-search request (beam.py)
        self.grammar: Any = None                # guided decoding: the compiled constraint (guided/constraint.py)

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # a plain loop: called per request several times a step
            if s.status is not RequestStatus.FINISHED:
                return False
        return True

    @property
    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]
