"""The role a weight plays (attention q/k/v/o, MLP gate/up/down, head, embeddings), for per-role quantization.

Roles come from the internal module path (``decoder.layers.3.self_attn.q_proj.weight``) and the registered
component name, never from a model family: the tables below are the whole mapping, so a component that names
its projections differently adds a line here (or a config names its tensors by glob instead).
"""
from __future__ import annotations

from typing import Any

ROLES = ("attn_q", "attn_k", "attn_v", "attn_o", "attn_qkv", "mlp_gate", "mlp_up", "mlp_down", "mlp_gate_up",
         "head", "embeddings", "other")

# The last element of a linear's module path: the attribute names components give their projections
# (components/attention.py, mlp.py, moe.py's shared expert).
LEAF_ROLES = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_o", "qkv_proj": "attn_qkv",
    "gate_proj": "mlp_gate", "up_proj": "mlp_up", "down_proj": "mlp_down", "gate_up_proj": "mlp_gate_up",
}
# The top-level flow a module path starts with (every linear of the spec's head: flow is the head).
PREFIX_ROLES = {"head": "head"}
# Registered component names whose weight plays a role wherever the spec puts them.
COMPONENT_ROLES = {"token_embedding": "embeddings"}
# Fused projections take the first of these roles that a config names (then the default).
FALLBACKS = {"attn_qkv": ("attn_qkv", "attn_v", "attn_q"), "mlp_gate_up": ("mlp_gate_up", "mlp_up", "mlp_gate")}


def role_of(module_path: str, module: Any = None) -> str:
    """The role of the weight of the module at ``module_path`` ("other" when no table names it)."""
    comp = getattr(module, "component_name", None)
    if comp in COMPONENT_ROLES:
        return COMPONENT_ROLES[comp]
    parts = module_path.split(".")
    if parts[0] in PREFIX_ROLES:
        return PREFIX_ROLES[parts[0]]
    return LEAF_ROLES.get(parts[-1], "other")


def lookup_order(role: str) -> tuple[str, ...]:
    """Config keys consulted for ``role``, most specific first."""
    return FALLBACKS.get(role, (role,))
