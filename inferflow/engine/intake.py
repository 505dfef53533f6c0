"""Turning a caller's prompt into engine state: tokenization, validation and per-sequence sampler state.

Bad input does not raise: the request is created failed (``error`` set) and finishes with finish_reason "error"
at the next step, so one bad request never disturbs the caller's other requests or the engine.
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence as Seq

import torch

from ..errors import InferflowError
from .beam import validate_beam
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .guided import make_guide, prepare as prepare_guided
from .handle import OutputStream
from .request import Request, Sequence
from .sampler import SeqSampling
from .sampling_params import SamplingParams
from .stop import StopChecker


class RequestIntake:
    def __init__(self, model: Any, config: EngineConfig, max_model_len: int):
        self.model, self.config, self.max_model_len = model, config, max_model_len
        self.tokenizer = model.tokenizer
        self.vocab_size = model.params.get("vocab_size")
        # prefix-cache key: blocks of another model (or dtype) must never match
        self.model_key = (model.spec.name, str(getattr(model.source, "path", "")), str(model.dtype))

    def tokens(self, prompt: str | Seq[int], what: str) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InferflowError(f"{what}: this model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        ids = list(map(int, prompt))
        # min/max first: one C-level pass each; the listing of bad ids only runs when there is one
        if ids and (min(ids) < 0 or (self.vocab_size and max(ids) >= self.vocab_size)):
            bad = [t for t in ids if t < 0 or (self.vocab_size and t >= self.vocab_size)]
            raise InferflowError(f"{what}: token id(s) {bad[:5]} outside the vocabulary (0..{self.vocab_size - 1})")
        return ids

    def request(self, rid: str, prompt: Any, params: SamplingParams, encoder_prompt: Any,
                      cache_salt: str | None) -> Request:
        arch = self.model.architecture
        ids, enc, error, grammar = [], None, None, None
        try:
            if arch == "encoder_only":
                raise InferflowError("this is an encoder-only model: use Engine.embed()")
            ids = self.tokens(prompt, "prompt")
            if arch == "encoder_decoder":
                enc = ids if encoder_prompt is None else self.tokens(encoder_prompt, "encoder_prompt")
                ids = self.model.decoder_start_ids() if encoder_prompt is None else ids
                if not enc:
                    raise InferflowError("encoder_prompt: empty")
            elif encoder_prompt is not None:
                raise InferflowError("encoder_prompt: only encoder-decoder models take one")
            if not ids:
                raise InferflowError("prompt: empty (a prompt needs at least one token)")
            if len(ids) > self.max_model_len:
                raise InferflowError(f"prompt: {len(ids)} tokens is longer than max_model_len = {self.max_model_len}")
            if params.n > self.config.max_num_seqs:
                raise InferflowError(f"n = {params.n} exceeds max_num_seqs = {self.config.max_num_seqs}")
            validate_beam(params, self.config.max_num_seqs)
            if params.stop and self.tokenizer is None:
                raise InferflowError("stop strings need a tokenizer; this model has none")
            grammar = prepare_guided(params, self.tokenizer)  # compiled once; each sequence gets a Guide
        except InferflowError as e:
            error = str(e)
        extra = (self.model_key, cache_salt, hashlib.sha256(repr(enc).encode()).hexdigest() if enc else None)
        req = Request(rid, ids, params, prompt=prompt if isinstance(prompt, str) else None, encoder_ids=enc,
                      hash_extra=extra, stream=OutputStream())
        req.grammar = grammar
        req.seqs.append(self.sequence(req, 0))
        req.error = error
        return req

    def sequence(self, req: Request, index: int) -> Sequence:
        p = req.params
        gen = None
        if p.seed is not None:  # each of the n sequences draws from its own seeded generator
            gen = torch.Generator(device=self.model.device).manual_seed(int(p.seed) + index)
        seq = Sequence(req, index, None)
        seq.sampling = SeqSampling(p, req.prompt_ids, seq.output_ids, gen)
        if req.grammar is not None:
            limit = self.max_model_len - len(req.prompt_ids)
            seq.sampling.guide = make_guide(req.grammar, self.tokenizer, self.vocab_size or self.tokenizer.vocab_size,
                                            self.model._stop_ids() | set(p.stop_token_ids),
                                            limit if p.max_tokens is None else min(limit, p.max_tokens))
        if self.tokenizer is not None:
            seq.detok = IncrementalDetokenizer(self.tokenizer, req.prompt_ids, p.skip_special_tokens)
            seq.stop = StopChecker(p.stop, p.include_stop_str_in_output)
        return seq
