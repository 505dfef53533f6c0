"""Sizing the engine for a model: its context length and the paged KV cache (tiers, dtype, host layers)."""
from __future__ import annotations

import logging
import math
from typing import Any

import torch

from ..errors import InferflowError
from .config import EngineConfig
from .kv_cache import PagedKVCache, kv_layers

log = logging.getLogger("inferflow.engine")

# hyper-parameter names specs use for the context length (HF config keys), most specific first
CONTEXT_PARAMS = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length", "max_sequence_length",
                  "context_length", "n_ctx")
DEFAULT_MAX_MODEL_LEN = 32768  # models that do not say (ALiBi, relative buckets): long, but still a bound
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
GiB = 1 << 30
CPU_KV_CACHE_GIB = 1.0     # the device tier's default size off CUDA (kv_cache_memory null)
FIXED_RESERVE = 1 << 30    # CUDA graph pools, cuBLAS/Triton workspaces and allocator slack beyond the estimate


def max_model_len(model: Any, config: EngineConfig) -> int:
    """Prompt + output cap: the config's, else the model's position limit, else a large default."""
    if config.max_model_len:
        return int(config.max_model_len)
    return _param(model, CONTEXT_PARAMS, DEFAULT_MAX_MODEL_LEN)


def kv_dtype(model: Any, config: EngineConfig) -> str:
    """The KV storage dtype name; "auto" is the model's dtype."""
    if config.kv_cache_dtype != "auto":
        return config.kv_cache_dtype
    return _DTYPE_NAMES.get(model.dtype, "float32")


def _param(model: Any, names: tuple[str, ...], default: int) -> int:
    """The first of ``names`` the model's hyper-parameters give as a positive integer, else ``default``."""
    for name in names:
        value = model.params.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


def activation_reserve(model: Any, config: EngineConfig) -> int:
    """Bytes a forward pass of ``max_num_batched_tokens`` tokens may need beyond weights and KV (an upper estimate).

    Per packed token: a few hidden-size buffers (residual, norm output, attention output), q/k/v and the MLP's
    gate, up and product, in the compute dtype, doubled for temporaries (casts, fused-kernel outputs); plus the
    float32 head logits of every sampled row with the sampler's copies (probabilities, sorted values, int64
    indices), and a fixed slack (CUDA graph pools, GEMM workspaces, allocator fragmentation).
    """
    hidden = _param(model, ("hidden_size", "n_embd", "d_model", "dim"), 4096)
    inter = _param(model, ("intermediate_size", "n_inner", "ffn_dim", "d_ff"), 4 * hidden)
    vocab = _param(model, ("vocab_size",), 32000)
    heads = _param(model, ("num_attention_heads", "n_head"), 32)
    head_dim = _param(model, ("head_dim",), max(1, hidden // heads))
    kv_heads = _param(model, ("num_key_value_heads",), heads)
    elem = torch.empty(0, dtype=model.dtype).element_size()
    per_token = elem * (4 * hidden + (heads + 2 * kv_heads) * head_dim + 3 * inter)
    rows = config.max_num_seqs * (1 + (config.num_speculative_tokens if config.speculative_model else 0))
    return 2 * config.max_num_batched_tokens * per_token + rows * vocab * 16 + FIXED_RESERVE


def device_kv_bytes(model: Any, config: EngineConfig) -> int:
    """Bytes for the device tier when ``num_blocks`` is not given: ``kv_cache_memory`` GiB when set; on CUDA
    (auto) ``gpu_memory_utilization * total - memory in use now (weights, context) - activation_reserve``,
    as vLLM sizes it; elsewhere (auto) 1 GiB."""
    if config.kv_cache_memory is not None:
        return int(config.kv_cache_memory * GiB)
    device = torch.device(model.device)
    if device.type != "cuda":
        return int(CPU_KV_CACHE_GIB * GiB)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # allocator-cached blocks (load-time temporaries) are free for the KV cache
    free, total = torch.cuda.mem_get_info(device)
    reserve = activation_reserve(model, config)
    budget = int(config.gpu_memory_utilization * total) - (total - free) - reserve
    if budget <= 0:
        raise InferflowError(
            f"no GPU memory left for the KV cache on {device}: {config.gpu_memory_utilization:.2f} x "
            f"{total / GiB:.1f} GiB - {(total - free) / GiB:.1f} GiB in use - {reserve / GiB:.1f} GiB activation "
            f"reserve <= 0; raise gpu_memory_utilization or give kv_cache_memory / num_blocks")
    return budget


def device_blocks(model: Any, config: EngineConfig, per_block: int, cap: int) -> int:
    """Device-tier blocks when ``num_blocks`` is not given: what ``device_kv_bytes`` holds, at most ``cap``."""
    num_blocks = max(1, min(cap, device_kv_bytes(model, config) // per_block))
    log.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s) on %s%s", num_blocks, config.block_size,
             num_blocks * per_block / GiB, kv_dtype(model, config), model.device,
             " (capped at max_num_seqs full-length sequences)" if num_blocks == cap else "")
    return num_blocks


def build_cache(model: Any, config: EngineConfig, model_len: int, draft: Any = None) -> PagedKVCache:
    """The paged KV cache for ``model``.

    Device blocks: ``num_blocks``, else as many as ``device_kv_bytes`` hold, capped at what the running
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
        num_blocks = device_blocks(model, config, per_block, cap)
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
