"""Engine limits and KV-cache settings (one per served model)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..errors import InferflowError
from .kv_store import STORE_DTYPES


@dataclass(slots=True)
class EngineConfig:
    """How the engine batches requests and sizes its paged KV cache.

    Names follow vLLM where a knob exists there (``max_num_seqs``, ``max_num_batched_tokens``,
    ``block_size``, ``enable_prefix_caching``, ``swap_space``); Inferflow's KV placement knob is
    ``host_kv_layers`` (the fraction of the last layers whose KV cache lives in host RAM).
    """

    max_num_seqs: int = 32                 # running sequences per step
    max_num_batched_tokens: int = 2048     # new tokens (decodes + prefill chunks) per forward pass
    max_model_len: int | None = None       # prompt + output cap; default: the model's context length
    block_size: int = 16                   # tokens per KV block
    num_blocks: int | None = None          # device-tier blocks; None: sized from kv_cache_memory
    kv_cache_memory: float | None = None   # GiB for the device tier; None: auto (CUDA: gpu_memory_utilization, CPU: 1)
    gpu_memory_utilization: float = 0.9    # CUDA, auto KV size: the fraction of the GPU weights + activations + KV may use
    swap_space: float = 1.0                # GiB of host RAM for swapped-out blocks (the host tier)
    num_host_blocks: int | None = None     # host-tier blocks; None: sized from swap_space
    preemption_mode: str = "recompute"     # "recompute" or "swap"
    max_waiting: int = 1024                # queued requests beyond this are refused as overloaded
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"           # "auto" (model dtype), "float32", "float16", "bfloat16", "int8", "fp8"
    host_kv_layers: float = 0.0            # fraction (0..1) of the last layers whose KV lives in host memory
    host_kv_compute: bool = False          # attend to host-tier layers on the CPU instead of copying per step
    host_embeddings: bool = False          # token-embedding tables in host RAM (a tied head stays on the device)
    seed: int = 0                          # engine RNG for requests without their own seed
    speculative_model: str | None = None   # draft model (folder or file) for speculative decoding, or "[ngram]"
    #                                        (prompt lookup: no draft model, engine/ngram.py); None: off
    speculative_draft_layers: int | None = None  # keep the draft's first N decoder layers (e.g. the target's own file)
    num_speculative_tokens: int = 4        # tokens the draft proposes per sequence and step
    ngram_prompt_lookup_max: int = 4       # "[ngram]": the longest n-gram looked up, then shorter ones
    ngram_prompt_lookup_min: int = 3       # "[ngram]": the shortest (shorter matches mispredict: docs/benchmarks.md)
    cuda_graphs: bool = True               # CUDA only: pure-decode steps replay captured graphs (False: eager)
    capture_graphs_at_start: bool = True   # capture every batch-size bucket's graph at start (False: on first use)
    cuda_graph_sizes: list[int] | None = None  # the graph buckets' row counts (vLLM's name); None: 1, 2, 4 .. 32,
    #                                        then steps of 8 to 64, 16 to 128, 32 to 256, ...; the larger of
    #                                        max_num_seqs and graph_prefill_tokens always closes the list; each
    #                                        graph keeps its float32 logits (rows x vocab x 4 bytes)
    graph_prefill_tokens: int = 128        # CUDA graphs: steps with prefill chunks of at most this many new tokens
    #                                        replay a static step too, each token a decode row (0: eager); a short
    #                                        prompt's first token 3.5-12x sooner on an H200 (docs/benchmarks.md)
    async_scheduling: bool | None = None   # overlap host work with pure-decode steps (overlap.py); None: CUDA only
    fuse_projections: bool | None = None   # q/k/v and gate/up as one GEMM each; None: on (CPU and CUDA)
    fuse_add_norm: bool | None = None      # residual add + next RMSNorm as one kernel; None: on CUDA only
    native_decode: bool | None = None      # CPU decode steps as one native program (model/native_decode.py); None: on

    def __post_init__(self) -> None:
        def bad(key: str, want: str) -> InferflowError:
            return InferflowError(f"engine config: {key} = {getattr(self, key)!r}; expected {want}")

        for key in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting", "num_speculative_tokens"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise bad(key, "a positive integer")
        # the step's head makes float32 logits for every row: 512 rows of a 152k vocabulary are 311 MB
        if not isinstance(self.graph_prefill_tokens, int) or not 0 <= self.graph_prefill_tokens <= 512:
            raise bad("graph_prefill_tokens", "an integer from 0 (off) to 512")
        sizes = self.cuda_graph_sizes
        if sizes is not None and (not isinstance(sizes, (list, tuple)) or not sizes or any(
                isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 4096 for v in sizes)):
            raise bad("cuda_graph_sizes", "null or a non-empty list of integers from 1 to 4096")
        if self.preemption_mode not in ("recompute", "swap"):
            raise bad("preemption_mode", "'recompute' or 'swap'")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in STORE_DTYPES:
            raise bad("kv_cache_dtype", f"auto or one of {', '.join(STORE_DTYPES)}")
        if not 0.0 <= float(self.host_kv_layers) <= 1.0:
            raise bad("host_kv_layers", "a fraction between 0 and 1")
        if self.kv_cache_memory is not None and (isinstance(self.kv_cache_memory, bool)
                                                 or not isinstance(self.kv_cache_memory, (int, float))
                                                 or self.kv_cache_memory <= 0):
            raise bad("kv_cache_memory", "a positive number of GiB or null (auto)")
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, (int, float)) \
                or not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad("gpu_memory_utilization", "a fraction in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise bad("num_blocks", "a positive integer or null")
        if self.speculative_draft_layers is not None and (not isinstance(self.speculative_draft_layers, int)
                                                          or self.speculative_draft_layers < 1):
            raise bad("speculative_draft_layers", "a positive integer or null")
        for key in ("ngram_prompt_lookup_min", "ngram_prompt_lookup_max"):
            if isinstance(getattr(self, key), bool) or not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise bad(key, "a positive integer")
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise bad("ngram_prompt_lookup_min", f"at most ngram_prompt_lookup_max ({self.ngram_prompt_lookup_max})")
        if self.speculative_model == "[ngram]" and self.speculative_draft_layers is not None:
            raise bad("speculative_draft_layers", 'null with speculative_model "[ngram]" (no draft model)')

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, where: str = "engine") -> "EngineConfig":
        """Build from a config mapping, naming unknown keys."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InferflowError(f"{where}: unknown key(s) {', '.join(unknown)}; expected some of {', '.join(sorted(known))}")
        return cls(**d)
