"""torch.distributed process groups of a placement: one TP group per pipeline stage, one PP group per TP rank.

Every rank must create every group in the same order (torch.distributed's rule), so all groups are built here
once. With world size 1 nothing is initialised and the collectives below are no-ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import InferflowError
from .placement import Placement


@dataclass(slots=True)
class ParallelGroups:
    rank: int
    world: int
    stage: int
    num_stages: int
    tp_rank: int
    tp_size: int
    tp_group: Any = None        # ranks of this stage
    pp_group: Any = None        # ranks with this tp_rank across stages (logits/encoder-output broadcasts)
    device: torch.device = torch.device("cpu")

    def stage_rank(self, stage: int) -> int:
        """Global rank of this TP rank's peer in another stage (activations go peer to peer)."""
        return stage * self.tp_size + self.tp_rank

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1


def rank_device(placement: Placement, rank: int) -> torch.device:
    """The placement's GPU of ``rank``; with no GPU ids named (``tensor_parallel: 2``) the launcher's LOCAL_RANK
    GPU when there are GPUs (``devices: cpu`` keeps the ranks on the CPU)."""
    import os

    idx = placement.device_index(rank)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # no GPU named, or one this node lacks (several nodes: ``0&1&2&3;4&5&6&7`` over 2 x 4 GPUs): LOCAL_RANK's
    if (idx is None and not placement.cpu or idx is not None and idx >= count) and count:
        idx = int(os.environ.get("LOCAL_RANK", rank)) % count
    return torch.device("cuda", idx) if idx is not None and torch.cuda.is_available() else torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, gloo between CPU processes."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_groups(placement: Placement, *, device: torch.device | None = None, init_method: str | None = None,
                rank: int | None = None, world_size: int | None = None) -> ParallelGroups:
    """Initialise torch.distributed for ``placement`` (unless already initialised: torchrun sets RANK etc.) and
    build its groups. ``device``: this rank's device (default: the placement's GPU of this rank, else CPU)."""
    need = placement.world_size
    if need == 1 and not dist.is_initialized():
        return ParallelGroups(0, 1, 0, 1, 0, 1, device=device or torch.device("cpu"))
    if not dist.is_initialized():
        if rank is None or world_size is None:
            import os

            rank, world_size = int(os.environ.get("RANK", -1)), int(os.environ.get("WORLD_SIZE", -1))
            if rank < 0:
                raise InferflowError(f"placement: {need} ranks needed; launch with torchrun --nproc-per-node {need}")
        if device is None:
            device = rank_device(placement, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's communicators bind to the current device
        dist.init_process_group(backend_for(device), init_method=init_method or "env://", rank=rank,
                                world_size=world_size)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != need:
        raise InferflowError(f"placement: needs {need} ranks (tensor_parallel {placement.tensor_parallel} x "
                             f"pipeline {placement.pipeline_parallel}), the process group has {world}")
    if device is None:
        device = rank_device(placement, rank)
    tp, pp = placement.tensor_parallel, placement.pipeline_parallel
    stage, tp_rank = placement.coords(rank)
    tp_group = pp_group = None
    for s in range(pp):
        g = dist.new_group([s * tp + t for t in range(tp)])
        if s == stage:
            tp_group = g
    for t in range(tp):
        g = dist.new_group([s * tp + t for s in range(pp)])
        if t == tp_rank:
            pp_group = g
    return ParallelGroups(rank, world, stage, pp, tp_rank, tp, tp_group, pp_group, device)
