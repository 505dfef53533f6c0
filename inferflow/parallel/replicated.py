"""Rank 0 owns the requests; the other ranks replay them (the engine side of a parallel placement).

Every rank holds an engine over its shard of the model. Rank 0 takes requests (``add_request``/``abort``, from
any thread, e.g. the service's HTTP front); at the start of each of its steps it broadcasts what it is about to
drain (new requests with their arguments, aborts) and the follower ranks, looping in :meth:`follow`, add exactly
those and run the same step. The scheduler is deterministic given the same inputs and every rank's RNG was
seeded alike by ``parallelize``, so every rank builds the same batch and the collectives inside the forward line
up: rank 0's drain is the step plan. :meth:`stop_followers` (rank 0) ends the followers' loops.
Not replicated yet: embedding / fill-mask batches (``Engine.embed``) — run those with a single process.
"""
from __future__ import annotations

import datetime
import threading
from typing import Any

import torch.distributed as dist

from ..engine.engine import Engine
from ..engine.request import Request


class _Stop(Exception):
    pass


class ReplicatedEngine(Engine):
    def __init__(self, model: Any, config: Any = None, draft: Any = None):
        super().__init__(model, config, draft)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        # requests travel as Python objects: a gloo group works whatever the tensors' backend (NCCL on GPUs)
        # (a long timeout: followers wait in a broadcast while the service idles)
        self._plan_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7)) \
            if dist.is_initialized() else None
        self._args: dict[str, tuple] = {}
        # held by rank 0 from the plan's snapshot to the end of the drain it describes, and by add/abort, so a
        # request arriving meanwhile waits for the next step's plan instead of being drained unannounced
        self._plan_lock = threading.Lock()

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
                            "abort": list(self._aborts)}
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
        return super()._drain()

    # ---- ranks > 0 ------------------------------------------------------------------------------
    def follow(self) -> None:
        """Run rank 0's steps until it calls :meth:`stop_followers`."""
        try:
            while True:
                self.step()
        except _Stop:
            return

