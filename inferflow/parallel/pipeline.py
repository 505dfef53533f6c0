"""Layer pipeline: each stage holds a contiguous range of a stack's layers; activations go stage to stage.

Stage 0 runs the embeddings, the last stage the final block and the head. A stage receives the hidden states
from its peer (the same tensor-parallel rank) of the previous stage, runs its layers and sends them on. Encoder
outputs are broadcast from the encoder's last stage to every stage (all decoder stages' cross-attention reads
them), logits from the last stage to all, so every rank returns the same values (SPMD: all ranks run the same
calls). Each stage's attention layers write only their own K/V, so the KV cache lives with the layers.
Micro-batches (micro.py) run a step's batch as several forwards in :func:`deferred` mode: hand-offs are
non-blocking sends and no output is broadcast until the step's last micro-batch, so stage s works on micro-batch
m while stage s+1 works on m-1.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .groups import ParallelGroups

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.float64]
_MAXDIM = 4


def _header(x: torch.Tensor) -> torch.Tensor:
    shape = list(x.shape) + [0] * (_MAXDIM - x.dim())
    return torch.tensor([x.dim(), _DTYPES.index(x.dtype), *shape], dtype=torch.int64)


def _empty(h: torch.Tensor, device: torch.device) -> torch.Tensor:
    nd, dt = int(h[0]), _DTYPES[int(h[1])]
    return torch.empty([int(s) for s in h[2:2 + nd]], dtype=dt, device=device)


def _comm_device(g: ParallelGroups) -> torch.device:
    return g.device if g.device.type == "cuda" else torch.device("cpu")  # NCCL needs CUDA tensors, gloo CPU


def send_tensor(x: torch.Tensor, dst: int, g: ParallelGroups) -> None:
    dev = _comm_device(g)
    dist.send(_header(x).to(dev), dst)
    dist.send(x.contiguous().to(dev), dst)


def isend_tensor(x: torch.Tensor, dst: int, g: ParallelGroups) -> list:
    """Non-blocking :func:`send_tensor`: (work, tensor) pairs to wait on (the tensors must outlive the sends)."""
    dev = _comm_device(g)
    h, buf = _header(x).to(dev), x.contiguous().to(dev)
    return [(dist.isend(h, dst), h), (dist.isend(buf, dst), buf)]


def recv_tensor(src: int, g: ParallelGroups, device: torch.device) -> torch.Tensor:
    dev = _comm_device(g)
    h = torch.empty(2 + _MAXDIM, dtype=torch.int64, device=dev)
    dist.recv(h, src)
    x = _empty(h.cpu(), dev)
    dist.recv(x, src)
    return x.to(device)


def broadcast_from_last(x: torch.Tensor | None, g: ParallelGroups, device: torch.device) -> torch.Tensor:
    """The last stage's ``x`` on every stage (within this TP rank's pipeline group)."""
    if g.num_stages == 1:
        return x
    dev, src = _comm_device(g), g.stage_rank(g.num_stages - 1)
    h = _header(x).to(dev) if g.last else torch.empty(2 + _MAXDIM, dtype=torch.int64, device=dev)
    dist.broadcast(h, src, group=g.pp_group)
    buf = x.contiguous().to(dev) if g.last else _empty(h.cpu(), dev)
    dist.broadcast(buf, src, group=g.pp_group)
    return buf.to(device)


class PipelineStack(nn.Module):
    """The stage ``g.stage`` part of a stack (layers ``start``..``stop``-1 of the original numbering)."""

    def __init__(self, stack: nn.Module, start: int, stop: int, g: ParallelGroups, broadcast_output: bool):
        super().__init__()
        self.stack_name, self.g, self.broadcast_output = stack.stack_name, g, broadcast_output
        self.start, self.stop = start, stop
        self.embed = stack.embed if g.first else None
        self.position = stack.position
        self.layers = nn.ModuleList(list(stack.layers)[start:stop])
        self.final = stack.final if g.last else None
        self.pending: list | None = None  # deferred mode (micro-batches): the sends in flight

    def forward(self, env: dict[str, Any], ctx: Any) -> torch.Tensor:
        g = self.g
        ctx.position = self.position
        ctx.stack = self.stack_name
        device = ctx.positions.device
        if g.first:
            x = self.embed(env, ctx) if self.embed is not None else env["x"]
        else:
            x = recv_tensor(g.stage_rank(g.stage - 1), g, device)
        for layer in self.layers:
            x = layer({"x": x}, ctx)
        if not g.last:
            if self.pending is not None:
                self.pending += isend_tensor(x, g.stage_rank(g.stage + 1), g)
            else:
                send_tensor(x, g.stage_rank(g.stage + 1), g)
        elif self.final is not None:
            x = self.final({"x": x}, ctx)
        if self.broadcast_output and self.pending is None:
            return broadcast_from_last(x if g.last else None, g, device)
        # a placeholder of the right row count: the head (PipelineHead) broadcasts the real result
        return x if g.last else x.new_zeros(x.shape)


class PipelineHead(nn.Module):
    """Runs the head on the last stage and broadcasts its output (logits) to the others."""

    def __init__(self, head: nn.Module | None, g: ParallelGroups):
        super().__init__()
        self.head, self.g = (head if g.last else None), g
        self.deferred = False  # micro-batches: the caller broadcasts the step's logits once

    def forward(self, env: dict[str, Any], ctx: Any) -> torch.Tensor:
        x = env["x"]
        y = self.head(env, ctx) if self.g.last else None
        if self.deferred:
            return y if self.g.last else x.new_zeros((x.shape[0], 0))
        return broadcast_from_last(y, self.g, x.device)


@contextlib.contextmanager
def deferred(net: nn.Module):
    """Within the block, the decoder pipeline sends without waiting and broadcasts nothing: only the last stage
    returns real logits (micro.py broadcasts them). Leaving the block waits for the sends."""
    stack, head = getattr(net, "decoder", None), getattr(net, "head", None)
    if not isinstance(stack, PipelineStack):
        yield
        return
    stack.pending = []
    if isinstance(head, PipelineHead):
        head.deferred = True
    try:
        yield
    finally:
        pending, stack.pending = stack.pending, None
        if isinstance(head, PipelineHead):
            head.deferred = False
        for work, _ in pending:
            work.wait()


def split_pipeline(net: nn.Module, ranges: list[tuple[int, int]], g: ParallelGroups,
                   encoder_ranges: list[tuple[int, int]] | None = None) -> None:
    """Keep only this stage's layers of ``net`` (in place). ``ranges``: [start, stop) per stage of the decoder
    (of the encoder for encoder-only nets); ``encoder_ranges``: the encoder's, for encoder-decoder nets."""
    if g.num_stages == 1:
        return
    dec, enc = getattr(net, "decoder", None), getattr(net, "encoder", None)
    head = getattr(net, "head", None)
    if dec is not None:
        a, b = ranges[g.stage]
        # the decoder's last hidden states reach every stage too (hidden_states() is an API of its own and they are
        # small next to logits); the head still runs on the last stage only and broadcasts its logits
        net.decoder = PipelineStack(dec, a, b, g, broadcast_output=True)
        if enc is not None:
            ea, eb = (encoder_ranges or ranges)[g.stage]
            net.encoder = PipelineStack(enc, ea, eb, g, broadcast_output=True)  # every stage's cross-attention
    elif enc is not None:
        a, b = ranges[g.stage]
        net.encoder = PipelineStack(enc, a, b, g, broadcast_output=True)
    if head is not None:
        net.head = PipelineHead(head, g)
