"""Where a model's token-embedding tables live: Inferflow's "embeddings in host RAM" placement.

A token-embedding table is one of the largest tensors of a model (vocab x hidden) yet a step reads only the rows
of its new tokens, so on a GPU it can stay in host memory: the lookup runs on the CPU and only the [N, hidden]
rows cross to the device (see ``TokenEmbedding.forward``). Components opt in with ``host_placeable = True``; no
family is named here.

A tied output head is NOT moved: the head multiplies every step's hidden states by the whole table, which on a
GPU must read it from VRAM at full bandwidth (copying it per step, or running the vocab projection on the CPU,
would cost far more than the memory saves). Heads load their own copy of a tied table, so moving the embedding
leaves the head where it is.

On a CPU-only machine host and device are the same memory: placing is a no-op move, yet the lookup code path
(look up where the table is, move the rows to the ids' device) is the same one that runs on a GPU.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

HOST = torch.device("cpu")


def host_placeable(net: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules (with their paths) whose tables may live in host RAM."""
    return [(name, m) for name, m in net.named_modules() if getattr(m, "host_placeable", False)]


def table_devices(net: nn.Module) -> dict[str, torch.device]:
    """Module path -> device of each placeable table (plain or block-quantized)."""
    out = {}
    for name, m in host_placeable(net):
        tensors = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        if tensors:
            out[name] = tensors[0].device
    return out


def place_embeddings(model: Any, host: bool = True) -> list[str]:
    """Keep the model's token-embedding tables in host RAM (``host=True``) or on the model's device again.

    Returns the paths of the tables placed. Records the choice as ``model.host_embeddings``. Moving happens after
    the weights are loaded, so on a GPU the tables pass through VRAM once while loading.
    """
    target = HOST if host else model.device
    placed = []
    for name, m in host_placeable(model.net):
        m.to(target)
        placed.append(name)
    model.host_embeddings = bool(host)
    if host and model.device.type == "cuda" and placed:
        torch.cuda.empty_cache()  # give the freed table memory back to the KV cache sizing that follows
    return placed
