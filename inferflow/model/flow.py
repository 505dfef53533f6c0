"""Flows: the ordered steps of an embedding block, a layer, a final block or a head.

A flow is a tiny dataflow program. Each step runs one component on the output of the previous
step (or on the named ``input``s) and binds its result to the step's name, so any residual wiring
(pre-norm, post-norm, parallel attention+MLP, shared or sandwich norms) is a few lines of spec.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .context import ForwardContext


def _hooks_set() -> bool:
    """Whether global module hooks are registered (then every step goes through nn.Module.__call__)."""
    g = nn.modules.module
    return bool(g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
                or g._global_backward_pre_hooks)


class Flow(nn.Module):
    """Runs its steps in order; step modules are children named after the steps (weights live under them)."""

    def __init__(self, steps: list[tuple[str, nn.Module, tuple[str, ...] | None]], first_input: str):
        super().__init__()
        self.plan: list[tuple[str, tuple[str, ...] | None]] = []
        for name, module, inputs in steps:
            self.add_module(name, module)
            self.plan.append((name, inputs))
        self.first_input = first_input

    def forward(self, env: dict[str, Any], ctx: ForwardContext) -> torch.Tensor:
        cur = env[self.first_input]
        mods = self._modules
        direct = not _hooks_set()
        for name, inputs in self.plan:
            if inputs is not None:
                cur = env[inputs[0]] if len(inputs) == 1 else [env[n] for n in inputs]
            m = mods[name]
            # a step without hooks runs its forward directly: nn.Module.__call__'s checks cost ~1 us a step
            cur = m.forward(cur, ctx) if direct and not (m._forward_hooks or m._forward_pre_hooks) else m(cur, ctx)
            env[name] = cur
        return cur


class Stack(nn.Module):
    """Embeddings, a position encoding, N layers and a final block: one encoder or decoder."""

    def __init__(self, name: str, embed: Flow | None, position: nn.Module | None, layers: list[Flow],
                 final: Flow | None):
        super().__init__()
        self.stack_name = name
        self.embed = embed
        self.position = position
        self.layers = nn.ModuleList(layers)
        self.final = final

    def forward(self, env: dict[str, Any], ctx: ForwardContext) -> torch.Tensor:
        ctx.position = self.position
        ctx.stack = self.stack_name
        x = self.embed(env, ctx) if self.embed is not None else env["x"]
        for layer in self.layers:
            x = layer({"x": x}, ctx)
        if self.final is not None:
            x = self.final({"x": x}, ctx)
        return x


class Net(nn.Module):
    """The assembled network: encoder and/or decoder stacks and an optional head flow."""

    def __init__(self, encoder: Stack | None, decoder: Stack | None, head: Flow | None):
        super().__init__()
        self.encoder, self.decoder, self.head = encoder, decoder, head
