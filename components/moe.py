"""Mixture of experts: a top-k router over gated experts (stacked weights), optional shared expert."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferflow.component import Component
from inferflow.registry import create, register

from .activations import activation


@register("moe")
class MoE(Component):
    """Expert weights are stacked: w_gate/w_up [E, I, H], w_down [E, H, I]; router [E, H]."""

    @dataclass(slots=True)
    class Params:
        hidden_size: int
        intermediate_size: int
        num_experts: int
        top_k: int
        activation: str = "silu"
        norm_topk_prob: bool = True      # renormalise the chosen experts' weights to sum to 1
        scoring: str = "softmax"         # "softmax" or "sigmoid"
        router_bias: bool = False
        shared_intermediate_size: int | None = None
        shared_gate: bool = False        # sigmoid gate on the shared expert (Qwen2-MoE)

    def __init__(self, p: Params):
        super().__init__()
        self.p = p
        self.act = activation(p.activation)
        self.router = create("linear", {"in_features": p.hidden_size, "out_features": p.num_experts,
                                        "bias": p.router_bias})
        self.declare("w_gate", (p.num_experts, p.intermediate_size, p.hidden_size))
        self.declare("w_up", (p.num_experts, p.intermediate_size, p.hidden_size))
        self.declare("w_down", (p.num_experts, p.hidden_size, p.intermediate_size))
        if p.shared_intermediate_size:
            self.shared = create("gated_mlp", {"hidden_size": p.hidden_size, "activation": p.activation,
                                               "intermediate_size": p.shared_intermediate_size})
            self.shared_gate = create("linear", {"in_features": p.hidden_size, "out_features": 1}) if p.shared_gate else None
        else:
            self.shared = self.shared_gate = None

    def forward(self, x, ctx=None):
        logits = self.router(x).float()
        probs = torch.softmax(logits, -1) if self.p.scoring == "softmax" else torch.sigmoid(logits)
        weights, idx = torch.topk(probs, self.p.top_k, dim=-1)
        if self.p.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.p.num_experts).tolist()
        tokens = order // self.p.top_k
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            sel = order[start:start + c]
            tok = tokens[start:start + c]
            start += c
            h = x[tok]
            y = F.linear(self.act(F.linear(h, self.w_gate[e])) * F.linear(h, self.w_up[e]), self.w_down[e])
            out.index_add_(0, tok, y * weights.flatten()[sel][:, None])
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            out = out + s
        return out
