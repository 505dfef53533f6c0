"""One entry point: shard an assembled, loaded Model for this rank of a placement (TP, then pipeline, then the
CPU/GPU hybrid), and a loader that initialises the process groups first."""
from __future__ import annotations

import os
from typing import Any

from .groups import ParallelGroups, init_groups
from .hybrid import place_cpu_layers
from .pipeline import split_pipeline
from .placement import Placement
from .tensor import shard_tensor_parallel


def parallelize(model: Any, placement: Placement | str | dict | None, groups: ParallelGroups | None = None, *,
                quant_kernels: str | None = None) -> Any:
    """Shard ``model`` in place for this rank; every rank must call it (SPMD). Returns the model, which then
    answers ``logits`` etc. identically on every rank. ``groups``: from :func:`init_groups` (built if None).
    Block-quantized weights must be held as blocks (load with ``quant_kernels="reference"``); their shards are
    stored back under ``quant_kernels`` (None: the default fast kernels)."""
    p = Placement.from_config(placement)
    g = groups if groups is not None else init_groups(p, device=model.device)
    net = model.net
    shard_tensor_parallel(net, g, vocab_size=model.params.get("vocab_size"), quant_kernels=quant_kernels)
    if g.num_stages > 1:
        main = net.decoder if getattr(net, "decoder", None) is not None else net.encoder
        ranges = p.stage_ranges(len(main.layers))
        enc_ranges = None
        if getattr(net, "decoder", None) is not None and getattr(net, "encoder", None) is not None:
            enc_ranges = Placement(pipeline_parallel=p.pipeline_parallel).stage_ranges(len(net.encoder.layers))
        split_pipeline(net, ranges, g, enc_ranges)
    place_cpu_layers(model, p.cpu_layers)
    if p.host_embeddings:
        from ..model.placement import place_embeddings

        place_embeddings(model)
    model.placement, model.parallel = p, g
    sync_rng(g)
    return model


def sync_rng(g: ParallelGroups) -> None:
    """Seed torch's global RNG the same on every rank (from rank 0's draw). Every rank samples the same tokens
    for unseeded requests too, so SPMD ranks never diverge (their next inputs must agree for the collectives)."""
    if g.world == 1:
        return
    import torch
    import torch.distributed as dist

    dev = g.device if g.device.type == "cuda" else torch.device("cpu")
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(dev)
    dist.broadcast(seed, 0)
    torch.manual_seed(int(seed.item()))


def load_parallel(source: str | os.PathLike, placement: Placement | str | dict, **load_kw: Any) -> Any:
    """``inferflow.load`` for this rank, then :func:`parallelize` (launch one process per rank, e.g. with
    ``torchrun --nproc-per-node N``; torchrun's RANK/WORLD_SIZE/MASTER_ADDR are read from the environment).

    Sharded while loading (several ranks): the weights load on the CPU as views of the memory-mapped file (no
    copy when the file's dtype is the target dtype), each rank slices out its shard (the only copy made) and only
    the shard moves to the rank's device, so neither host memory nor the GPU ever holds the whole model per rank.
    Tensors a spec transform builds (transposes, concatenations, stacked experts) and dtype conversions are
    materialised whole in host memory before slicing."""
    import torch

    from ..model.model import as_dtype, load

    p = Placement.from_config(placement)
    g = init_groups(p)
    if g.device.type == "cuda" and (g.world > 1 or load_kw.get("device") is None):
        load_kw["device"] = g.device  # each rank its own GPU, whatever a shared config's ``device`` says
    kernels = load_kw.pop("quant_kernels", None)
    target = torch.device(load_kw.get("device") or "cpu")
    staged = g.world > 1 and target.type != "cpu"
    if staged:
        load_kw["dtype"] = as_dtype(load_kw.get("dtype"), target)
        load_kw["device"] = "cpu"
        kernels = "reference"  # blocks as loading on the device holds them (no CPU-only repacked forms)
    # blocks stay sliceable while loading; the shards get the requested kernels afterwards
    model = load(source, quant_kernels="reference" if g.tp_size > 1 or staged else kernels, **load_kw)
    model = parallelize(model, p, g, quant_kernels=kernels)
    if staged:
        model.net.to(target)  # this rank's shard only
        model.device = target
        if p.host_embeddings:
            from ..model.placement import place_embeddings

            place_embeddings(model)
    return model
