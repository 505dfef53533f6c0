"""Running a configured model on a parallel placement from the service and ``llm_inference``.

A model entry's ``placement`` that needs several ranks (``0&1``, ``tensor_parallel: 2``) runs one process per rank.
Under ``torchrun`` (RANK/WORLD_SIZE set) every process is already a rank; otherwise the command re-launches itself
for ranks 1..N-1 (:func:`spawn_ranks`: the same command line with torchrun's environment variables, on this host)
and becomes rank 0. Every rank loads its shard; rank 0 owns the requests (HTTP front, query file) and the others
replay its step plans (:class:`~inferflow.parallel.replicated.ReplicatedEngine`).
"""
from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
from typing import Any

from ..errors import InferflowError
from .placement import Placement


def world_of(cfg: Any) -> int:
    """Ranks a model config's placement needs (1 when it has none)."""
    return Placement.from_config(getattr(cfg, "placement", None)).world_size


def under_launcher() -> bool:
    """True when torchrun (or :func:`spawn_ranks`) made this process a rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launched_world() -> int:
    """WORLD_SIZE a launcher set (0 when none did)."""
    return int(os.environ["WORLD_SIZE"]) if under_launcher() else 0


def this_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(world: int, module: str, argv: list[str]) -> list[subprocess.Popen]:
    """Start ranks 1..world-1 as ``python -m module argv`` on this host and make this process rank 0.

    The children get torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); they are
    terminated when this process exits, so a failed rank 0 leaves no follower waiting in a collective."""
    if under_launcher():
        have = int(os.environ["WORLD_SIZE"])
        if have != world:
            raise InferflowError(f"placement: the model's placement needs {world} rank(s), the launcher started "
                                 f"{have} (set the model's placement key, or --nproc-per-node {world})")
        return []
    port = str(_free_port())
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world)}
    procs = []
    for r in range(1, world):
        env = {**os.environ, **base, "RANK": str(r), "LOCAL_RANK": str(r)}
        procs.append(subprocess.Popen([sys.executable, "-m", module, *argv], env=env))
    os.environ.update({**base, "RANK": "0", "LOCAL_RANK": "0"})

    def _reap() -> None:
        for p in procs:
            try:
                p.wait(timeout=30)  # followers exit once rank 0 released them
            except subprocess.TimeoutExpired:
                p.terminate()

    atexit.register(_reap)
    return procs


def load_replicated(cfg: Any, progress: Any = None) -> tuple[Any, Any]:
    """(model shard, ReplicatedEngine) of a model config with a multi-rank placement, on this rank."""
    from ..service.served_model import load_model
    from .replicated import ReplicatedEngine

    model = load_model(cfg, progress=progress)
    return model, ReplicatedEngine(model, cfg.engine)


def close() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def run_job_parallel(job: Any, run: Any, argv: list[str], module: str = "inferflow.cli") -> int:
    """``llm_inference`` on several ranks: ``run(served)`` on rank 0 (the others follow its steps)."""
    from ..service.served_model import ServedModel

    spawn_ranks(world_of(job.model), module, argv)
    try:
        model, engine = load_replicated(job.model)
        if engine.rank != 0:
            engine.follow()
            return 0
        try:
            run(ServedModel(job.model, model, engine))
        finally:
            engine.stop_followers()
    finally:
        close()
    return 0
