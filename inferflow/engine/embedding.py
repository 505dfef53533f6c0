"""Encoder-only requests: embeddings (pooled as ``Model.embed`` pools) and fill-mask scores (fill_mask.py),
queued together and run as encoder batches by engine steps.

A step runs either decoder work or one encoder batch (alternating when both wait), packing queued texts
under the same ``max_num_batched_tokens`` / ``max_num_seqs`` limits as generation.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..errors import InferflowError
from .fill_mask import FillMaskOutput, mask_positions, mask_token_id, rank
from .outputs import EmbeddingOutput


@dataclass(slots=True)
class _Job:
    request_id: str
    ids: list[int]
    output: EmbeddingOutput | FillMaskOutput | None = None
    mask: list[int] | None = None   # fill-mask: the masked positions (None: an embedding request)
    top_k: int = 0
    done: threading.Event = field(default_factory=threading.Event)


class EmbeddingQueue:
    def __init__(self, engine: Any):
        self.engine = engine
        self._queue: deque[_Job] = deque()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.ran_last = False   # the previous step was an encoder batch (alternate with decoder work)

    def pending(self) -> int:
        return len(self._queue)

    def _tokens(self, item: str | Sequence[int], what: str = "embed") -> list[int]:
        eng = self.engine
        if isinstance(item, str):
            if eng.tokenizer is None:
                raise InferflowError(f"{what}: this model has no tokenizer; pass token ids")
            ids = eng.tokenizer.encode(item)
        else:
            ids = [int(t) for t in item]
        if not ids:
            raise InferflowError(f"{what}: an input has no tokens")
        if len(ids) > eng.max_model_len:
            raise InferflowError(f"{what}: {len(ids)} tokens is longer than max_model_len = {eng.max_model_len}")
        return ids

    def embed(self, texts: str | Sequence[str] | Sequence[Sequence[int]]) -> torch.Tensor:
        """Queue the inputs, wait for their encoder batches, return [n, hidden] float32."""
        if isinstance(texts, str) or (texts and all(isinstance(t, int) for t in texts)):
            texts = [texts]
        jobs = [_Job(f"embed-{next(self._ids)}", self._tokens(t)) for t in texts]
        self._wait(jobs)
        errors = [j.output.error for j in jobs if j.output.error]
        if errors:
            raise InferflowError(f"embed failed: {errors[0]}")
        return torch.stack([j.output.embedding for j in jobs]) if jobs else torch.zeros(0)

    def fill_mask(self, texts: str | Sequence[str] | Sequence[Sequence[int]], top_k: int = 5,
                  mask_id: int | None = None) -> list[FillMaskOutput]:
        """Queue masked inputs, wait for their encoder batches, return the top-k tokens per mask position."""
        model = self.engine.model
        if model.architecture != "encoder_only" or model.net.head is None:
            raise InferflowError(f"fill_mask: needs an encoder-only model with an MLM head; spec "
                                 f"{model.spec.name!r} is {model.architecture}"
                                 f"{'' if model.net.head is not None else ' without a head'}")
        if not isinstance(top_k, int) or top_k < 1:
            raise InferflowError(f"fill_mask: top_k = {top_k!r}; expected a positive integer")
        if isinstance(texts, str) or (texts and all(isinstance(t, int) for t in texts)):
            texts = [texts]
        mask_id = mask_token_id(self.engine.tokenizer, mask_id)
        jobs = []
        for t in texts:
            ids = self._tokens(t, "fill_mask")
            jobs.append(_Job(f"mlm-{next(self._ids)}", ids, mask=mask_positions(ids, mask_id), top_k=top_k))
        self._wait(jobs)
        errors = [j.output.error for j in jobs if j.output.error]
        if errors:
            raise InferflowError(f"fill_mask failed: {errors[0]}")
        return [j.output for j in jobs]

    def _wait(self, jobs: list[_Job]) -> None:
        with self._lock:
            self._queue.extend(jobs)
        self.engine._wake.set()
        for job in jobs:
            while not job.done.is_set():
                if self.engine.background:
                    job.done.wait(0.1)
                else:
                    self.engine.step()

    def run_batch(self) -> list[EmbeddingOutput | FillMaskOutput]:
        """One encoder batch of queued inputs (at least one, then while the limits allow)."""
        cfg = self.engine.config
        batch: list[_Job] = []
        tokens = 0
        with self._lock:
            while self._queue and len(batch) < cfg.max_num_seqs:
                n = len(self._queue[0].ids)
                if batch and tokens + n > cfg.max_num_batched_tokens:
                    break
                batch.append(self._queue.popleft())
                tokens += n
        try:
            outs = self.engine.runner.encoder_batch([j.ids for j in batch], [j.mask for j in batch])
            for j, v in zip(batch, outs):
                j.output = (EmbeddingOutput(j.request_id, j.ids, v) if j.mask is None else
                            FillMaskOutput(j.request_id, j.ids, j.mask, rank(v, j.top_k, self.engine.tokenizer)))
        except Exception as e:  # noqa: BLE001 - fail this batch, not the engine
            for j in batch:
                err = f"{type(e).__name__}: {e}"
                j.output = (EmbeddingOutput(j.request_id, j.ids, None, error=err) if j.mask is None else
                            FillMaskOutput(j.request_id, j.ids, j.mask, error=err))
        self.engine.counters.embedding_requests += sum(j.mask is None for j in batch)
        self.engine.counters.fill_mask_requests += sum(j.mask is not None for j in batch)
        self.ran_last = True
        for j in batch:
            j.done.set()
        return [j.output for j in batch]
