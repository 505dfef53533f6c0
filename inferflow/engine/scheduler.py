"""Continuous batching with chunked prefill, prefix-cache admission and preemption.

Every step packs work for ONE forward pass under a token budget (``max_num_batched_tokens``) and a sequence
cap (``max_num_seqs``), in this order:

1. running sequences: decodes first (one token each), then the next chunks of partly computed prompts, oldest
   admission first. A decode that cannot get a block preempts the most recently admitted running sequence
   not yet scheduled this step (possibly itself): in "recompute" mode its blocks are freed and it is requeued
   at the front of the waiting queue (generated tokens kept, re-prefilled with the prompt; the prefix cache
   makes that cheap); in "swap" mode its blocks are copied to the host tier and it waits in ``swapped``
   (recompute when the host tier is full). A prefill chunk shrinks to the blocks available instead.
2. swapped sequences come back (``swap_in``) when their blocks fit, oldest first;
3. waiting sequences are admitted in order while their whole remaining prompt fits in the free blocks
   (admitting what cannot finish its prefill would only cause preemptions): the prefix cache supplies the
   leading full blocks it holds, except the block of the last token, which must be computed for its logits.
   Nothing new is admitted in a step that had to preempt, or while swapped sequences wait.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_pool import NoFreeBlocks
from .config import EngineConfig
from .kv_cache import PagedKVCache
from .request import RequestStatus, Sequence


@dataclass(slots=True)
class Scheduled:
    """``num_tokens`` new tokens of ``seq`` computed this step, starting at position ``start``."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """The chunk reaches the sequence's last token: its logits give the next token."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[Scheduled] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[tuple[Sequence, str]] = field(default_factory=list)   # can never fit: finish with an error

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, config: EngineConfig, cache: PagedKVCache):
        self.config, self.cache, self.pool = config, cache, cache.pool
        self.block_size = cache.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # admission order
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_cached_prompt_tokens = 0

    # ---- queues ---------------------------------------------------------------------------------
    def add(self, seq: Sequence, front: bool = False) -> None:
        seq.status = RequestStatus.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def free(self, seq: Sequence) -> None:
        """Drop a sequence from every queue and give back its device and host blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.pool.release(seq.block_table)
        if seq.host_blocks:
            self.cache.host_pool.release(seq.host_blocks)
        seq.block_table, seq.host_blocks, seq.num_registered = [], [], 0

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        done: set[int] = set()
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for s in self.running:  # one pass (num_tokens is a property): this is O(batch) every step
            rem = s.num_tokens - s.num_computed
            if rem == 1:
                decodes.append(s)
            elif rem > 1:
                prefills.append(s)
        bs, sched = self.block_size, out.scheduled
        running = RequestStatus.RUNNING
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not running:
                continue  # preempted (or failed) for an earlier one in this loop
            n = min(seq.num_tokens - seq.num_computed, budget)
            # steady-state decode: the token fits the blocks it already has (no allocation, no preemption)
            if not (n == 1 and seq.num_computed < len(seq.block_table) * bs):
                n = self._reserve(seq, n, done, out)
            if n:
                sched.append(Scheduled(seq, seq.num_computed, n))
                done.add(id(seq))
                budget -= n
        if out.preempted:
            return out
        budget = self._swap_in(budget, done, out)
        if not self.swapped:  # swapped sequences come back before anything new starts
            self._admit(budget, out)
        return out

    def _reserve(self, seq: Sequence, n: int, done: set[int], out: SchedulerOutput) -> int:
        """Blocks for ``n`` more tokens of a running sequence: shrink a prefill chunk or preempt; returns n."""
        bs = self.block_size
        while True:
            need = _cdiv(seq.num_computed + n, bs) - len(seq.block_table)
            if need <= self.pool.num_free:
                seq.block_table += self.pool.allocate(max(need, 0))
                return n
            room = len(seq.block_table) * bs - seq.num_computed + self.pool.num_free * bs
            if n > 1 and room > 0:
                n = room
                continue
            victims = [s for s in self.running if id(s) not in done]
            victim = max(victims, key=lambda s: s.admitted)
            if victim is seq and len(self.running) == 1:
                self.free(seq)
                out.failed.append((seq, f"the KV cache ({self.pool.num_blocks} blocks of {bs} tokens) cannot hold "
                                        f"this sequence's {seq.num_computed + n} tokens"))
                return 0
            self._preempt(victim, out)
            if victim is seq:
                return 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        out.preempted.append(seq)
        if self.config.preemption_mode == "swap" and seq.block_table:
            try:
                seq.host_blocks = self.cache.swap_out(seq.block_table)
            except NoFreeBlocks:
                pass  # host tier full: recompute instead
            else:
                self.pool.release(seq.block_table)
                seq.block_table, seq.num_registered = [], 0
                self.swapped.append(seq)
                self.num_swap_outs += 1
                return
        self.pool.release(seq.block_table)
        seq.block_table, seq.num_computed, seq.num_registered = [], 0, 0
        self.waiting.appendleft(seq)  # victims come latest-admitted first, so the oldest ends up in front

    def _swap_in(self, budget: int, done: set[int], out: SchedulerOutput) -> int:
        bs = self.block_size
        self.swapped.sort(key=lambda s: s.admitted)
        while self.swapped and budget > 0 and self._seats() < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if _cdiv(seq.num_computed + n, bs) > self.pool.num_free:
                break
            self.swapped.pop(0)
            seq.block_table = self.cache.swap_in(seq.host_blocks)
            seq.host_blocks = []
            seq.status = RequestStatus.RUNNING
            self.running.append(seq)
            n = self._reserve(seq, n, done, out)
            out.scheduled.append(Scheduled(seq, seq.num_computed, n))
            done.add(id(seq))
            budget -= n
        return budget

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        bs = self.block_size
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self._seats() + self._seats_of(seq) > self.config.max_num_seqs:
                break
            if _cdiv(seq.num_tokens, bs) > self.pool.num_blocks:
                self.waiting.popleft()
                self.free(seq)
                out.failed.append((seq, f"the KV cache ({self.pool.num_blocks} blocks of {bs} tokens) cannot "
                                        f"hold this sequence's {seq.num_tokens} tokens"))
                continue
            self._match_prefix(seq)  # waiting sequences hold no blocks
            if _cdiv(seq.num_tokens, bs) - len(seq.block_table) > self.pool.num_free:
                self._unmatch(seq)
                break
            self.waiting.popleft()
            if seq.index == 0 and not seq.sampled_before:  # prompt tokens the prefix cache supplied
                seq.request.num_cached_tokens = seq.num_computed
                self.num_cached_prompt_tokens += seq.num_computed
            seq.admit()
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            seq.block_table += self.pool.allocate(_cdiv(seq.num_computed + n, bs) - len(seq.block_table))
            out.scheduled.append(Scheduled(seq, seq.num_computed, n))
            budget -= n

    @staticmethod
    def _seats_of(seq: Sequence) -> int:
        """Running sequences this one will be: a request's first sequence forks into n (or beam_width beams) at its
        first token."""
        p = seq.request.params
        return max(p.n, p.beam_width if p.use_beam_search else 1) if seq.index == 0 and not seq.sampled_before else 1

    def _seats(self) -> int:
        return sum(self._seats_of(s) for s in self.running)

    # ---- prefix cache ---------------------------------------------------------------------------
    def _match_prefix(self, seq: Sequence) -> None:
        """Take the cached leading full blocks, never the one holding the last token (its logits are needed)."""
        bs = self.block_size
        self._counts = (self.pool.hits, self.pool.queries)
        usable = (seq.num_tokens - 1) // bs
        if not self.pool.enable_caching:  # nothing to match: skip hashing the prompt (~1 ms per 8k tokens)
            self.pool.queries += usable
            usable = 0
        blocks = self.pool.match_prefix(seq.full_block_hashes(usable, bs)) if usable else []
        seq.block_table, seq.num_computed, seq.num_registered = blocks, len(blocks) * bs, len(blocks)

    def _unmatch(self, seq: Sequence) -> None:
        """Undo a match for a sequence that has to keep waiting (and keep the hit-rate counters honest)."""
        if seq.block_table:
            self.pool.release(seq.block_table)
            self.pool.hits, self.pool.queries = self._counts
            seq.block_table, seq.num_computed, seq.num_registered = [], 0, 0

    def commit(self, out: SchedulerOutput) -> None:
        """After a successful forward: the scheduled tokens are computed; offer newly full blocks to the cache."""
        bs = self.block_size
        for sc in out.scheduled:
            seq = sc.seq
            seq.num_computed = sc.start + sc.num_tokens
            full = seq.num_computed // bs
            if self.pool.enable_caching and full > seq.num_registered:
                hashes = seq.full_block_hashes(full, bs)
                for i in range(seq.num_registered, full):
                    self.pool.cache_block(seq.block_table[i], hashes[i])
                seq.num_registered = full

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares ``parent``'s full blocks and gets a copy of its partly filled last block."""
        bs = self.block_size
        full = parent.num_computed // bs
        shared = parent.block_table[:full]
        child.block_hashes = parent.block_hashes[:full]
        if parent.num_computed % bs:
            try:
                own = self.pool.allocate(1)
            except NoFreeBlocks:
                self.add(child, front=True)  # no block to copy into: prefill it later (prefix cache helps)
                return
            self.cache.copy_blocks([parent.block_table[full]], own)
        else:
            own = []
        self.pool.incref(shared)
        child.block_table = shared + own
        child.num_computed, child.num_registered = parent.num_computed, min(parent.num_registered, full)
        child.admit()
        self.running.append(child)
