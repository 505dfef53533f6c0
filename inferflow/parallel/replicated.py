"""Rank 0 owns the requests; the other ranks replay them (the engine side of a parallel placement).

Every rank holds an engine over its shard of the model. Rank 0 takes requests (``add_request``/``abort``, from
any thread, e.g. the service's HTTP front); at the start of each of its steps it broadcasts what it is about to
drain (new requests with their arguments, aborts) and the follower ranks, looping in :meth:`follow`, add exactly
those and run the same step. The scheduler is deterministic given the same inputs and every rank's RNG was
seeded alike by ``parallelize``, so every rank builds the same batch and the collectives inside the forward line
up: rank 0's drain is the step plan. :meth:`stop_followers` (rank 0) ends the followers' loops.
Embedding / fill-mask inputs (``Engine.embed``) wait in an inbox on rank 0 until a plan carries them into every
rank's encoder queue, so every rank runs the same encoder batches at the same steps.
"""
from __future__ import annotations

import dataclasses
import datetime
import threading
from typing import Any

import torch.distributed as dist

from ..engine.embedding import EmbeddingQueue, _Job
from ..engine.engine import Engine
from ..engine.request import Request


class _Stop(Exception):
    pass


class _PlannedEmbeddings(EmbeddingQueue):
    """Rank 0's encoder inputs enter the queue only through a step plan (``ReplicatedEngine._drain``)."""

    def __init__(self, engine: Any):
        super().__init__(engine)
        self.inbox: list[_Job] = []

    def _wait(self, jobs: list[_Job]) -> None:
        eng = self.engine
        if eng._plan_group is None:
            return super()._wait(jobs)
        with eng._plan_lock:
            self.inbox.extend(jobs)
        eng._wake.set()
        for job in jobs:
            while not job.done.is_set():
                if eng.background:
                    job.done.wait(0.1)
                else:
                    eng.step()

    def take_inbox(self) -> list[tuple]:
        """(rank 0, under the plan lock) move the inbox into the queue; what the plan tells the followers."""
        jobs, self.inbox = self.inbox, []
        with self._lock:
            self._queue.extend(jobs)
        return [(j.request_id, j.ids, j.mask, j.top_k) for j in jobs]

    def add_planned(self, items: list[tuple]) -> None:
        with self._lock:
            self._queue.extend(_Job(rid, list(ids), mask=mask, top_k=top_k) for rid, ids, mask, top_k in items)


class ReplicatedEngine(Engine):
    def __init__(self, model: Any, config: Any = None, draft: Any = None):
        placement = getattr(model, "placement", None)
        if placement is not None and placement.world_size > 1 and getattr(config, "cuda_graphs", False):
            # captured decode graphs are unchecked with collectives (and a pipeline reads shapes on the host)
            config = dataclasses.replace(config, cuda_graphs=False)
        super().__init__(model, config, draft)
        if placement is not None and placement.micro_batches > 1:
            from .micro import use_micro_batches

            use_micro_batches(self, placement.micro_batches)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # requests travel as Python objects: a gloo group works whatever the tensors' backend (NCCL on GPUs)
        # (a long timeout: followers wait in a broadcast while the service idles)
        self._plan_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7)) \
            if dist.is_initialized() else None
        self._args: dict[str, tuple] = {}
        # held by rank 0 from the plan's snapshot to the end of the drain it describes, and by add/abort, so a
        # request arriving meanwhile waits for the next step's plan instead of being drained unannounced
        self._plan_lock = threading.Lock()
        self.embeddings = _PlannedEmbeddings(self)

    # ---- rank 0 ---------------------------------------------------------------------------------
    def add_request(self, prompt: Any, params: Any = None, *, request_id: str | None = None,
                    encoder_prompt: Any = None, cache_salt: str | None = None):
        rid = str(request_id) if request_id is not None else f"req-{next(self._ids)}"
        with self._plan_lock:
            self._args[rid] = (prompt, params, encoder_prompt, cache_salt)
            try:
                return super().add_request(prompt, params, request_id=rid, encoder_prompt=encoder_prompt,
                                           cache_salt=cache_salt)
            except Exception:
                self._args.pop(rid, None)
                raise

    def abort(self, request_id: str) -> None:
        # always through the next step's plan, so every rank aborts at the same point
        with self._plan_lock, self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def stop_followers(self) -> None:
        if self.rank == 0 and self._plan_group is not None:
            dist.broadcast_object_list([None], src=0, group=self._plan_group)

    def _drain(self) -> dict[str, Request]:
        if self._plan_group is None:
            return super()._drain()
        if self.rank == 0:
            with self._plan_lock:
                with self._lock:
                    plan = {"add": [(r.request_id, self._args.pop(r.request_id)) for r in self._inbox],
                            "abort": list(self._aborts), "encode": self.embeddings.take_inbox()}
                dist.broadcast_object_list([plan], src=0, group=self._plan_group)
                return super()._drain()
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self._plan_group)
        if box[0] is None:
            raise _Stop
        for rid, args in box[0]["add"]:
            prompt, params, encoder_prompt, cache_salt = args
            Engine.add_request(self, prompt, params, request_id=rid, encoder_prompt=encoder_prompt,
                               cache_salt=cache_salt)
        with self._lock:
            self._aborts.extend(box[0]["abort"])
        self.embeddings.add_planned(box[0]["encode"])
        return super()._drain()

    def _has_work(self) -> bool:
        return super()._has_work() or bool(self.embeddings.inbox)

    # ---- ranks > 0 ------------------------------------------------------------------------------
    def follow(self) -> None:
        """Run rank 0's steps until it calls :meth:`stop_followers`."""
        try:
            while True:
                self.step()
        except _Stop:
            return

