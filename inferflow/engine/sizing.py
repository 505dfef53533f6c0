"""Sizing the engine for a model: its context length and the paged KV cache (tiers, dtype, host layers)."""
from __future__ import annotations

import math
from typing import Any

import torch

from .config import EngineConfig
from .kv_cache import PagedKVCache, kv_layers

# hyper-parameter names specs use for the context length (HF config keys), most specific first
CONTEXT_PARAMS = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length", "max_sequence_length",
                  "context_length", "n_ctx")
DEFAULT_MAX_MODEL_LEN = 32768  # models that do not say (ALiBi, relative buckets): long, but still a bound
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
GiB = 1 << 30


def max_model_len(model: Any, config: EngineConfig) -> int:
    """Prompt + output cap: the config's, else the model's position limit, else a large default."""
    if config.max_model_len:
        return int(config.max_model_len)
    for name in CONTEXT_PARAMS:
        value = model.params.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return DEFAULT_MAX_MODEL_LEN


def kv_dtype(model: Any, config: EngineConfig) -> str:
    """The KV storage dtype name; "auto" is the model's dtype."""
    if config.kv_cache_dtype != "auto":
        return config.kv_cache_dtype
    return _DTYPE_NAMES.get(model.dtype, "float32")


def build_cache(model: Any, config: EngineConfig, model_len: int, draft: Any = None) -> PagedKVCache:
    """The paged KV cache for ``model``.

    Device blocks: ``num_blocks``, else as many as ``kv_cache_memory`` GiB hold, capped at what the running
    sequences could ever use (``max_num_seqs`` full-length sequences: more would only hold cache). Host
    (swap) blocks: ``num_host_blocks``, else ``swap_space`` GiB in swap mode (recompute mode needs none).
    ``host_kv_layers``: the last ``ceil(fraction * layers)`` KV layers keep their blocks in host memory.
    A speculative ``draft`` model's KV layers (keys renumbered past the target's) live in the same blocks, so
    block tables, prefix caching, swapping and copy-on-write cover both models at once.
    """
    layers = kv_layers(model)
    draft_layers = kv_layers(draft) if draft is not None else []
    bs = config.block_size
    dtype = kv_dtype(model, config)
    per_block = max(1, PagedKVCache.bytes_per_block(layers + draft_layers, bs, dtype))
    cap = config.max_num_seqs * math.ceil(model_len / bs)
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    elif not layers:
        num_blocks = 1  # encoder-only: nothing is cached
    else:
        num_blocks = max(1, min(cap, int(config.kv_cache_memory * GiB) // per_block))
    if config.num_host_blocks is not None:
        num_host = config.num_host_blocks
    elif config.preemption_mode == "swap" and layers:
        num_host = min(cap, int(config.swap_space * GiB) // per_block)
    else:
        num_host = 0
    keys = [layer.key for layer in layers]
    n_host_layers = math.ceil(float(config.host_kv_layers) * len(keys))
    host_layers = frozenset(keys[len(keys) - n_host_layers:]) if n_host_layers else frozenset()
    return PagedKVCache(layers + draft_layers, num_blocks, bs, dtype=dtype, compute_dtype=model.dtype,
                        device=model.device, num_host_blocks=num_host, host_layers=host_layers,
                        host_compute=config.host_kv_compute, enable_caching=config.enable_prefix_caching,
                        cpu_layers=getattr(model, "cpu_kv_keys", frozenset()))  # placement cpu_layers
