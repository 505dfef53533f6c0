"""CPU/GPU hybrid in one process (``cpu_layers: N``): the embeddings and the first N layers run on the CPU, the
rest (and the final block and head) on the model's device.

Hidden states cross once per forward. Each part gets its own ForwardContext view (positions, encoder output and
the per-forward memo of cos/sin tables live on that part's device) and its own copy of the position module. On a
CPU-only machine both parts are the CPU, yet the same split and transfer code runs.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
from torch import nn

from ..errors import InferflowError

CPU = torch.device("cpu")


def _view(ctx: Any, device: torch.device, position: nn.Module | None) -> Any:
    enc = ctx.encoder_out
    tt = ctx.token_type_ids
    return dataclasses.replace(ctx, positions=ctx.positions.to(device), position=position, memo={},
                               encoder_out=None if enc is None else enc.to(device),
                               token_type_ids=None if tt is None else tt.to(device))


class HybridStack(nn.Module):
    def __init__(self, stack: nn.Module, cpu_layers: int, device: torch.device):
        super().__init__()
        n = len(stack.layers)
        if cpu_layers > n:
            raise InferflowError(f"cpu_layers: {cpu_layers} but the {stack.stack_name} has only {n} layers")
        self.stack_name, self.device = stack.stack_name, device
        self.embed = stack.embed.to(CPU) if stack.embed is not None else None
        self.cpu_layers = nn.ModuleList(list(stack.layers)[:cpu_layers]).to(CPU)
        self.layers = nn.ModuleList(list(stack.layers)[cpu_layers:]).to(device)
        self.final = stack.final.to(device) if stack.final is not None else None
        self.position = stack.position.to(device) if stack.position is not None else None
        # the CPU part's own copy (RoPE tables, relative-bias weights) so neither part moves tables per step
        self.cpu_position = copy.deepcopy(stack.position).to(CPU) if stack.position is not None else None

    def forward(self, env: dict[str, Any], ctx: Any) -> torch.Tensor:
        c = _view(ctx, CPU, self.cpu_position)
        c.stack = ctx.stack = self.stack_name
        if self.embed is not None:
            x = self.embed({k: v.to(CPU) if isinstance(v, torch.Tensor) else v for k, v in env.items()}, c)
        else:
            x = env["x"].to(CPU)
        for layer in self.cpu_layers:
            x = layer({"x": x}, c)
        x = x.to(self.device)  # the one crossing per forward
        ctx.position = self.position
        for layer in self.layers:
            x = layer({"x": x}, ctx)
        if self.final is not None:
            x = self.final({"x": x}, ctx)
        return x


def place_cpu_layers(model: Any, cpu_layers: int) -> None:
    """Run the first ``cpu_layers`` layers (and the embeddings) of the model's main stack on the CPU."""
    if cpu_layers <= 0:
        return
    net = model.net
    name = "decoder" if getattr(net, "decoder", None) is not None else "encoder"
    stack = HybridStack(getattr(net, name), cpu_layers, model.device)
    setattr(net, name, stack)
    # the paged engine keeps these layers' K/V in host memory and attends there (engine/sizing.py)
    model.cpu_kv_keys = frozenset(m.cache_key for m in stack.cpu_layers.modules()
                                  if getattr(m, "uses_kv_cache", False) and not getattr(m, "cross", False)) \
        if name == "decoder" else frozenset()
