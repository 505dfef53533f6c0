"""Per-sequence sampling state and the sampler's randomness: ``SeqSampling`` (a seeded request gets its own
``torch.Generator``), the ``SampleOutput`` of one sampler call, the exponential race's Exp(1) noise (``exp_noise``)
and the host -> device transfer of a batch's per-row settings (``small_tensor``, ``column``). See sampler.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .logits_processors import NGramPenalty
from .sampling_params import SamplingParams

GREEDY_BELOW = 1e-5  # temperatures under this are greedy (dividing by them overflows nothing, but means nothing)


@dataclass(slots=True)
class SeqSampling:
    """Mutable per-sequence sampling state the engine keeps with a sequence."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    mirostat_mu: float | None = None        # mirostat v2's running surprise cap; starts at 2 * tau
    eos_bypassed: int = 0                   # EOS tokens replaced so far (eos_bypass_max)
    fsd_ngram: NGramPenalty | None = None   # FSD's n-gram model, updated incrementally
    guide: Any = None                       # guided decoding: the sequence's Guide (guided/constraint.py)

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids: list[int], device: str | torch.device = "cpu",
               index: int = 0) -> "SeqSampling":
        """Fresh state; a seeded request gets its own generator (on ``device``, where its noise is drawn), seeded
        ``seed + index`` so the n parallel samples of one request differ (vLLM's rule for n > 1)."""
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(int(params.seed) + index)
        return cls(params, list(prompt_ids), [], gen)


@dataclass(slots=True)
class SampleOutput:
    tokens: list[int]
    logprobs: list[float] | None                          # raw-logit logprob of each chosen token
    top_logprobs: list[list[tuple[int, float]]] | None    # per row, its top-N (N = params.logprobs)


def small_tensor(values: list[int], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list on ``device`` without a host sync (a pageable copy waits for the stream: an overlapped
    step queued behind would stall the host)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def column(values: list[float], device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return small_tensor(values, device, dtype)[:, None]


def exp_noise(seqs: list[SeqSampling], V: int, dev: torch.device, generator: torch.Generator | None) -> torch.Tensor:
    """``[n, V]`` Exp(1) draws: a seeded row from its own generator only (V draws every step); unseeded rows from
    ``generator`` (None: torch's default one)."""
    shared = [i for i, sq in enumerate(seqs) if sq.generator is None]
    gdev = generator.device if generator is not None else dev
    if len(shared) == len(seqs):  # no seeded row: one draw, no row scatter (the same numbers)
        return torch.empty(len(seqs), V, device=gdev).exponential_(generator=generator).to(dev)
    q = torch.empty(len(seqs), V, device=dev)
    if shared:
        draws = torch.empty(len(shared), V, device=gdev).exponential_(generator=generator)
        q[small_tensor(shared, dev)] = draws.to(dev)
    for i, sq in enumerate(seqs):
        if sq.generator is not None:
            q[i] = torch.empty(V, device=sq.generator.device).exponential_(generator=sq.generator).to(dev)
    return q
