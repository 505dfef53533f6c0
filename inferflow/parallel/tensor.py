"""Tensor parallelism: which component is sharded how, as a rule table keyed by component name (data, not
families), applied to an assembled and loaded model.

Rules (Megatron-style): attention splits its query heads by rank (contiguous ranges; KV heads split too, or
replicated when there are fewer KV heads than ranks so each rank keeps the one its queries use); q/k/v and
gate/up projections are column-parallel (output rows sliced; a fused projection is sliced per section), o_proj
and down_proj are row-parallel (input columns sliced, then an all-reduce and the bias added once); a MoE splits
every expert's intermediate dimension (and its shared expert's) with one all-reduce after the block; token
embeddings and the vocab projection of the head are vocab-parallel. Anything not named here (norms, routers,
pooling, ...) is replicated: each rank computes it identically on identical inputs.
"""
from __future__ import annotations

import contextvars
from typing import Callable

import torch
from torch import nn

from ..errors import InferflowError
from . import packed_split
from .groups import ParallelGroups
from .tp_modules import GatherColumns, HeadSlicedPosition, RowParallel, VocabParallelEmbedding


def _param(t: torch.Tensor) -> nn.Parameter:
    """A slice as a tensor of its own: the one copy made of it (the loaded tensor may be a view of the file)."""
    return nn.Parameter(t.clone() if t.is_contiguous() else t.contiguous(), requires_grad=False)


# the kernel set packed shards are stored back under (parallelize's ``quant_kernels``)
_KERNELS: contextvars.ContextVar[str | None] = contextvars.ContextVar("tp_quant_kernels", default=None)


def take_rows(lin: nn.Module, path: str, ranges: list[tuple[int, int]]) -> None:
    """Column-parallel: keep output rows ``ranges`` (concatenated in order) of a linear and its bias."""
    idx = torch.cat([torch.arange(a, b) for a, b in ranges])
    if getattr(lin, "packed", None) and "weight" in lin.packed:
        t = packed_split.take_rows(packed_split.held(lin, "weight", path), ranges)
        packed_split.rehold(lin, "weight", t, linear=True, kernels=_KERNELS.get())
    else:
        lin.weight = _param(lin.weight.index_select(0, idx.to(lin.weight.device)))
    if lin.bias is not None:
        lin.bias = _param(lin.bias.index_select(0, idx.to(lin.bias.device)))
    lin.out_features = int(idx.numel())


def take_cols(lin: nn.Module, path: str, a: int, b: int) -> torch.Tensor | None:
    """Row-parallel: keep input columns [a, b); returns the bias, removed so it is added once after the reduce."""
    if getattr(lin, "packed", None) and "weight" in lin.packed:
        t = packed_split.take_cols(packed_split.held(lin, "weight", path), a, b, path + ".weight")
        packed_split.rehold(lin, "weight", t, linear=True, kernels=_KERNELS.get())
    else:
        lin.weight = _param(lin.weight[:, a:b])
    lin.in_features = b - a
    bias, lin.bias = lin.bias, None
    return None if bias is None else bias.detach().clone()


def _split(n: int, g: ParallelGroups, what: str) -> tuple[int, int]:
    if n % g.tp_size:
        raise InferflowError(f"tensor_parallel: {what} ({n}) is not divisible by {g.tp_size} ranks")
    k = n // g.tp_size
    return g.tp_rank * k, (g.tp_rank + 1) * k


def attention_heads(m: nn.Module, g: ParallelGroups) -> tuple[int, int, int, int]:
    """(first q head, q heads, first kv head, kv heads) of this rank."""
    q0, q1 = _split(m.h, g, f"{m.h} attention heads")
    if m.hkv >= g.tp_size:
        k0, k1 = _split(m.hkv, g, "num_key_value_heads")
        return q0, q1 - q0, k0, k1 - k0
    if g.tp_size % m.hkv:
        raise InferflowError(f"tensor_parallel: {g.tp_size} ranks cannot share {m.hkv} KV heads evenly")
    return q0, q1 - q0, q0 // (m.h // m.hkv), 1  # replicated: the KV head of this rank's query group


def shard_attention(m: nn.Module, path: str, g: ParallelGroups) -> nn.Module:
    if getattr(m, "q_norm", None) is not None and not m.qk_norm_per_head:
        raise InferflowError(f"{path}: a q/k norm over the whole projection needs all heads; not sharded yet")
    d = m.d
    q0, hl, k0, kl = attention_heads(m, g)
    qr, kr = (q0 * d, (q0 + hl) * d), (k0 * d, (k0 + kl) * d)
    if getattr(m, "qkv_proj", None) is not None and m.fused and not m.cross:
        qd, kvd = m.qd, m.kvd
        take_rows(m.qkv_proj, path + ".qkv_proj", [qr, (qd + kr[0], qd + kr[1]), (qd + kvd + kr[0], qd + kvd + kr[1])])
    else:
        take_rows(m.q_proj, path + ".q_proj", [qr])
        take_rows(m.k_proj, path + ".k_proj", [kr])
        take_rows(m.v_proj, path + ".v_proj", [kr])
    bias = take_cols(m.o_proj, path + ".o_proj", *qr)
    m.o_proj = RowParallel(m.o_proj, g.tp_group, bias)
    m.h, m.hkv, m.qd, m.kvd = hl, kl, hl * d, kl * d
    return m


def shard_mlp(m: nn.Module, path: str, g: ParallelGroups, reduce: bool = True) -> nn.Module:
    """Plain and gated MLPs; ``reduce=False`` leaves the partial sum (and bias) to an enclosing reduce."""
    if getattr(m, "fused", False):
        a, b = _split(m.inter, g, "intermediate_size")
        take_rows(m.gate_up_proj, path + ".gate_up_proj", [(a, b), (m.inter + a, m.inter + b)])
        m.inter = b - a
    else:
        a, b = _split(m.up_proj.out_features, g, "intermediate_size")
        for name in ("gate_proj", "up_proj"):
            if getattr(m, name, None) is not None:
                take_rows(getattr(m, name), f"{path}.{name}", [(a, b)])
        if hasattr(m, "inter"):
            m.inter = b - a
    bias = take_cols(m.down_proj, path + ".down_proj", a, b)
    if reduce:
        m.down_proj = RowParallel(m.down_proj, g.tp_group, bias)
    elif bias is not None and g.tp_rank == 0:
        m.down_proj.bias = _param(bias)  # added by one rank only: the enclosing all-reduce sums it once
    return m


def shard_moe(m: nn.Module, path: str, g: ParallelGroups) -> nn.Module:
    a, b = _split(m.p.intermediate_size, g, "moe intermediate_size")
    m.w_gate = _param(m.w_gate[:, a:b, :])
    m.w_up = _param(m.w_up[:, a:b, :])
    m.w_down = _param(m.w_down[:, :, a:b])
    if m.shared is not None:
        # sigmoid(gate(x)) * sum_r s_r == sum_r sigmoid(gate(x)) * s_r: one reduce after the block suffices
        shard_mlp(m.shared, path + ".shared", g, reduce=False)
    return RowParallel(m, g.tp_group)


def vocab_range(vocab: int, g: ParallelGroups) -> tuple[int, int, int]:
    """(start, stop, chunk): an uneven vocab is split in ceil-sized chunks (the last rank's may be short)."""
    chunk = -(-vocab // g.tp_size)
    start = min(vocab, g.tp_rank * chunk)
    return start, min(vocab, start + chunk), chunk


def shard_embedding(m: nn.Module, path: str, g: ParallelGroups) -> nn.Module:
    packed = getattr(m, "packed", None) and "weight" in m.packed
    vocab = m.packed["weight"][1][0] if packed else m.weight.shape[0]
    start, stop, _ = vocab_range(vocab, g)
    if packed:
        t = packed_split.take_rows(packed_split.held(m, "weight", path), [(start, stop)])
        packed_split.rehold(m, "weight", t, linear=False)
    else:
        m.weight = _param(m.weight[start:stop])
    return VocabParallelEmbedding(m, g.tp_group, start, stop)


def shard_head_linear(lin: nn.Module, path: str, g: ParallelGroups) -> nn.Module:
    vocab = lin.out_features
    start, stop, chunk = vocab_range(vocab, g)
    take_rows(lin, path, [(start, stop)])
    return GatherColumns(lin, g.tp_group, g.tp_size, vocab, chunk)


# component name -> shard(module, path, groups) -> the module to put in its place
RULES: dict[str, Callable[[nn.Module, str, ParallelGroups], nn.Module]] = {
    "attention": shard_attention,
    "mlp": shard_mlp,
    "gated_mlp": shard_mlp,
    "moe": shard_moe,
    "token_embedding": shard_embedding,
}


def _walk(parent: nn.Module, prefix: str, g: ParallelGroups, rules: dict) -> None:
    for name, child in list(parent._modules.items()):
        if child is None:
            continue
        path = f"{prefix}.{name}" if prefix else name
        rule = rules.get(getattr(child, "component_name", None))
        if rule is not None:
            parent._modules[name] = rule(child, path, g)  # a sharded block's children are its rule's business
        else:
            _walk(child, path, g, rules)


def shard_tensor_parallel(net: nn.Module, g: ParallelGroups, vocab_size: int | None = None,
                          rules: dict | None = None, quant_kernels: str | None = None) -> None:
    """Shard ``net`` in place for this rank of its tensor-parallel group (``quant_kernels``: the kernel set the
    packed shards are held under; None: the environment's / default)."""
    if g.tp_size == 1:
        return
    token = _KERNELS.set(quant_kernels)
    try:
        _shard(net, g, vocab_size, RULES if rules is None else rules)
    finally:
        _KERNELS.reset(token)


def _shard(net: nn.Module, g: ParallelGroups, vocab_size: int | None, rules: dict) -> None:
    for stack_name in ("encoder", "decoder"):
        stack = getattr(net, stack_name, None)
        if stack is None:
            continue
        pos = getattr(stack, "position", None)
        if pos is not None and hasattr(pos, "bias_fn"):
            att = next((m for m in stack.modules() if getattr(m, "component_name", None) == "attention"
                        and not m.cross), None)
            if att is not None:
                q0, hl, _, _ = attention_heads(att, g)
                stack.position = HeadSlicedPosition(pos, q0, hl)
        _walk(stack, stack_name, g, rules)
    head = getattr(net, "head", None)
    if head is not None:
        lins = [(n, m) for n, m in head._modules.items() if getattr(m, "component_name", None) == "linear"]
        # the vocab projection: the linear producing vocab_size outputs (else the head's last linear)
        pick = [(n, m) for n, m in lins if vocab_size is not None and m.out_features == vocab_size] or lins[-1:]
        for n, m in pick:
            head._modules[n] = shard_head_linear(m, f"head.{n}", g)
