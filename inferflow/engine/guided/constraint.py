"""Constrained (guided) decoding: a request's constraint compiled once, and the per-sequence Guide that picks tokens.

A request asks through SamplingParams: ``guided_json`` (True or {}: any JSON object; a dict: a JSON schema, see
schema.py) or ``guided_choice`` (exactly one of the strings), optionally between ``guided_prefix`` and
``guided_suffix`` (fixed text, e.g. a chat template's tool-call markers). EOS and stop token ids are allowed
only once the whole constraint is complete.

Choosing lazily. Testing 49k tokens against the matcher every step would cost more than the model, so the sampler
hands each constrained row its ranking scores and the Guide tests candidates best first until one is valid:
- greedy rows rank by the processed logits: the first valid candidate is the constrained argmax;
- sampled rows rank by the exponential race ``log p - log q`` over the TRUNCATED distribution (the scores the
  sampler's own argmax uses): the first valid candidate is an exact sample from the truncated distribution
  restricted to valid tokens (the race's winner among a subset is a sample from that subset), i.e. the invalid
  candidates tested on the way are masked and the draw is among the valid top candidates;
- only when no truncated candidate is valid does it rank by the untruncated race (a sample from the full
  distribution restricted to valid tokens), and only then by token id through the whole vocabulary, which
  includes tokens the logit processors masked (the constraint wins over them; a dead end would be worse).
Candidates come in growing top-k chunks (32, 256, 2048, ...), so a full sort happens only when needed.

Token budget: a candidate is also refused when what it leaves could not be completed in the tokens left
(``min(max_tokens, max_model_len - prompt)``), counting one byte per token; so a random model is steered to close
its JSON before ``max_tokens`` instead of being cut mid-value. When the budget is already too small for that
(small max_tokens), every token must shorten the shortest completion (multi-byte tokens may still make it); when
no candidate fits, validity alone decides.
"""
from __future__ import annotations

import json
import math
from typing import Any, Iterator

import torch

from ...errors import InferflowError
from . import json_matcher as jm
from .budget import cost, ws_room
from .schema import ANY_OBJECT, Lit, Node, compile_schema
from .token_bytes import TokenTable, token_table

Items = tuple[tuple[Node, bool], ...]
OK, BAD, OVER = 0, 1, 2


def is_guided(params: Any) -> bool:
    return (params.guided_json is not None and params.guided_json is not False) or params.guided_choice is not None


def compile_guided(params: Any) -> Items:
    """The grammar items of a request's constraint (InferflowError / SchemaError when it is malformed)."""
    gj, choice = params.guided_json, params.guided_choice
    if gj is not None and gj is not False and choice is not None:
        raise InferflowError("guided decoding: give guided_json or guided_choice, not both")
    items: list[tuple[Node, bool]] = []
    if params.guided_prefix:
        items.append((Lit((params.guided_prefix.encode("utf-8"),)), False))
    if choice is not None:
        if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
            raise InferflowError("guided_choice: expected a non-empty list of non-empty strings")
        items.append((Lit(tuple(c.encode("utf-8") for c in choice)), False))
    elif gj is True or isinstance(gj, (dict, str)):
        schema = True if gj is True else _schema(gj)
        items.append((ANY_OBJECT if schema is True or schema == {} else compile_schema(schema), True))
    else:
        raise InferflowError(f"guided_json: expected true, a JSON schema object or null, not {type(gj).__name__}")
    if params.guided_suffix:
        items.append((Lit((params.guided_suffix.encode("utf-8"),)), False))
    return tuple(items)


def _schema(value: dict | str) -> Any:
    if isinstance(value, dict):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise InferflowError(f"guided_json: not valid JSON: {e}") from None


def prepare(params: Any, tokenizer: Any) -> Items | None:
    """Validate a request's constraint against the other settings and compile it (None: not guided)."""
    if not is_guided(params):
        if params.guided_prefix or params.guided_suffix:
            raise InferflowError("guided_prefix / guided_suffix need guided_json or guided_choice")
        return None
    if tokenizer is None:
        raise InferflowError("guided decoding needs a tokenizer; this model has none")
    return validate(params)


def validate(params: Any) -> Items:
    """Refuse settings guided decoding cannot honour; the compiled constraint otherwise."""
    for bad, what in ((params.use_beam_search, "beam search"), (params.mirostat, "mirostat"),
                      (params.fsd_alpha > 0, "fsd"), (params.eos_bypass_max > 0, "eos_bypass_max"),
                      (params.ignore_eos, "ignore_eos")):
        if bad:
            raise InferflowError(f"guided decoding cannot be combined with {what} (greedy and random sampling, "
                                 f"with any truncation, are supported)")
    return compile_guided(params)


def make_guide(items: Items, tokenizer: Any, vocab_size: int, end_ids: set[int], limit: int | None) -> "Guide":
    return Guide(items, token_table(tokenizer, vocab_size), end_ids, limit)


class Guide:
    """One sequence's matcher state; ``pick`` chooses (and commits) its next token."""

    __slots__ = ("configs", "table", "end_ids", "limit", "_memo")

    def __init__(self, items: Items, table: TokenTable, end_ids: set[int], limit: int | None):
        self.configs = jm.initial(items)
        self.table, self.end_ids, self.limit = table, frozenset(end_ids), limit
        self._memo: dict[int, tuple] = {}  # first byte -> state after it, for this step's candidates

    @property
    def complete(self) -> bool:
        """Whether the constraint is satisfied by what was written so far (EOS allowed)."""
        return jm.complete(self.configs)

    def _after(self, b: int) -> tuple:
        st = self._memo.get(b)
        if st is None:
            st = self._memo[b] = jm.feed(self.configs, bytes((b,)))
        return st

    def _check(self, tok: int, budget: int | None) -> tuple[int, tuple]:
        if tok in self.end_ids:
            return (OK if jm.complete(self.configs) else BAD), ()
        data = self.table.data[tok] if tok < len(self.table) else None
        if not data:
            return BAD, ()
        first = self._after(data[0])
        new = jm.feed(first, data[1:]) if first and len(data) > 1 else first
        if not new:
            return BAD, ()
        return (OVER if budget is not None and cost(new) > budget else OK), new

    def _masks(self, budget: int | None, V: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Over token ids: ``valid`` (the first two bytes continue the state) and ``fits`` (also, the budget may
        hold: a byte lowers the cost by at most one, so cost(token) >= cost(first two bytes) - (len - 2)).
        Pairs are tried only when few first bytes are allowed (outside strings); else first bytes alone."""
        first_ok = [b for b in range(256) if self._after(b)]
        ok = torch.zeros(257, 257, dtype=torch.bool)
        costs = torch.zeros(257, 257, dtype=torch.long)
        pairs = len(first_ok) <= PAIR_FILTER
        for b in first_ok:
            st = self._after(b)
            c1 = cost(st) if budget is not None else 0
            ok[b, 256], costs[b, 256] = True, c1
            if not pairs:
                ok[b, :256], costs[b, :256] = True, c1 - 1
                continue
            for b2 in range(256):
                st2 = jm.feed(st, bytes((b2,)))
                if st2:
                    ok[b, b2], costs[b, b2] = True, cost(st2) if budget is not None else 0
        first, second, length = self.table.first[:V], self.table.second[:V], self.table.length[:V]
        valid = ok[first, second]
        room = ws_room(self.configs)
        if room is not None:  # whitespace-only tokens longer than the whitespace still allowed
            valid &= ~(self.table.blank[:V] & (length > room))
        fits = valid.clone()
        if budget is not None:
            fits &= costs[first, second] - (length - 2).clamp_min(0) <= budget
        if V > len(first):  # logits columns past the table (padding) are never written
            valid = torch.cat([valid, valid.new_zeros(V - len(first))])
            fits = torch.cat([fits, fits.new_zeros(V - len(first))])
        ends = [e for e in self.end_ids if e < V]
        valid[ends] = fits[ends] = jm.complete(self.configs)
        return valid, fits

    def pick(self, primary: torch.Tensor, backup: torch.Tensor, produced: int) -> int:
        """The best valid token by ``primary`` (then ``backup``, then id order); commits it."""
        budget = None
        if self.limit is not None:  # feasible at one byte per token: keep it so; else every token must make
            budget = max(self.limit - produced, cost(self.configs)) - 1  # progress (multi-byte tokens may)
        tested: set[int] = set()
        spare: tuple[int, tuple] | None = None  # the first valid candidate that breaks the budget

        def first_ok(candidates: Iterator[int], stop_at_spare: bool = False) -> tuple[int, tuple] | None:
            nonlocal spare
            for tok in candidates:
                status, new = self._check(tok, budget)
                if status == OK:
                    return tok, new
                if status == OVER and spare is None:
                    spare = tok, new
                    if stop_at_spare:
                        return None
            return None

        orders = [primary] if backup is primary else [primary, backup]
        # the few best first: a model that writes what the grammar wants stops here
        hit = first_ok(_candidates(orders[:1], tested, None, FIRST))
        if hit is None:  # then only tokens whose first bytes continue the state and whose budget bound holds
            valid, fits = self._masks(budget, primary.shape[0])
            hit = first_ok(_candidates(orders, tested, fits))
            if hit is None and spare is None:  # no candidate keeps the budget: a valid one at least
                first_ok(_candidates(orders, tested, valid), stop_at_spare=True)
        if hit is None:
            hit = spare
        if hit is not None:
            return self._commit(*hit)
        # a dead end (the vocabulary cannot write what the grammar needs): end the sequence
        return min(self.end_ids) if self.end_ids else int(primary.argmax())

    def _commit(self, tok: int, new: tuple) -> int:
        if tok not in self.end_ids:
            self.configs = new
        self._memo = {}
        return tok


FIRST = 32          # candidates tried before the vectorised filters are built
PAIR_FILTER = 24    # filter by two leading bytes when at most this many first bytes are allowed


def _candidates(orders: list[torch.Tensor], tested: set[int], mask: torch.Tensor | None,
                limit: int | None = None) -> Iterator[int]:
    """Untested token ids (within ``mask``) best first by each score row in turn, finite scores only, then (with a
    mask) the remaining ids of the mask in id order: tokens the logit processors set to -inf come last."""
    for row in orders:
        if mask is not None:
            row = row.masked_fill(~mask, -math.inf)
        V, k = row.shape[0], 0
        end = V if limit is None else min(V, limit)
        while k < end:
            nk = min(end, max(FIRST, k * 8))
            vals, ids = row.topk(nk)
            for v, i in zip(vals[k:].tolist(), ids[k:].tolist()):
                if v == -math.inf:
                    nk = end
                    break
                if i not in tested:
                    tested.add(i)
                    yield i
            k = nk
    if mask is not None:
        for i in mask.nonzero()[:, 0].tolist():
            if i not in tested:
                tested.add(i)
                yield i


def pick_guided(tokens: list[int], scores: torch.Tensor, backup: torch.Tensor, seqs: list[Any]) -> None:
    """Replace the tokens of constrained rows (``seqs[b].guide``) by their guides' picks (the sampler's hook).
    Rows move to the CPU once: the walk reads them a few values at a time."""
    for b, sq in enumerate(seqs):
        if sq.guide is not None:
            row = scores[b].float().cpu()
            alt = row if backup is scores else backup[b].float().cpu()
            tokens[b] = sq.guide.pick(row, alt, len(sq.output_ids))
