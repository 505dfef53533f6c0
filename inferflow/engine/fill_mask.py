"""Masked-LM requests (fill-mask): the top-k tokens the MLM head scores at each mask position of an input.

Inferflow's encoder-only output lists "rank, token, id, score" at the mask; here every mask position of every
input gets such a list. ``score`` is the softmax probability over the vocabulary (what HF's fill-mask pipeline
reports), ``logit`` the raw head output. Requests go through the engine's encoder batches (embedding.py),
packed with embedding requests under the same limits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..errors import InferflowError

# Inferflow's default mask text (its mask_token setting), tried after the tokenizer's own mask_token
DEFAULT_MASK_TEXTS = ("[MASK]", "<mask>")


@dataclass(slots=True)
class MaskPrediction:
    rank: int               # 1 = best
    token: str | None       # the vocabulary entry (None without a tokenizer)
    id: int
    score: float            # softmax probability at this position
    logit: float


@dataclass(slots=True)
class FillMaskOutput:
    """One input's result: ``predictions[j]`` ranks the candidates for the mask at ``positions[j]``."""

    request_id: str
    prompt_token_ids: list[int]
    positions: list[int]
    predictions: list[list[MaskPrediction]] = field(default_factory=list)
    finished: bool = True
    error: str | None = None


def mask_token_id(tokenizer: Any, explicit: int | None = None) -> int:
    """The mask token id: ``explicit``, else the tokenizer's mask_token, else a conventional mask text."""
    if explicit is not None:
        return int(explicit)
    if tokenizer is not None:
        named = (getattr(tokenizer, "special_tokens", None) or {}).get("mask_token")
        for text in ([named] if named else []) + list(DEFAULT_MASK_TEXTS):
            i = tokenizer.token_to_id(text)
            if i is not None:
                return int(i)
    raise InferflowError("fill_mask: no mask token known for this model; pass mask_token_id")


def mask_positions(ids: Sequence[int], mask_id: int) -> list[int]:
    pos = [j for j, t in enumerate(ids) if t == mask_id]
    if not pos:
        raise InferflowError(f"fill_mask: an input has no mask token (id {mask_id})")
    return pos


def rank(logits: torch.Tensor, top_k: int, tokenizer: Any) -> list[list[MaskPrediction]]:
    """Per row of ``logits`` [M, vocab]: the ``top_k`` best tokens, best first."""
    if logits.shape[0] == 0:
        return []
    k = min(top_k, logits.shape[-1])
    probs = torch.softmax(logits.float(), dim=-1)
    top_p, top_i = probs.topk(k, dim=-1)
    top_l = logits.float().gather(-1, top_i)
    out = []
    for ps, ids, ls in zip(top_p.tolist(), top_i.tolist(), top_l.tolist()):
        out.append([MaskPrediction(r + 1, tokenizer.id_to_token(i) if tokenizer is not None else None, i, p, lg)
                    for r, (p, i, lg) in enumerate(zip(ps, ids, ls))])
    return out
