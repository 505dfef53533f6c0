"""Engine counters and gauges, and their Prometheus text exposition."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# name -> (type, help); gauges describe the engine now, counters only grow
_DOC: dict[str, tuple[str, str]] = {
    "running": ("gauge", "Sequences holding KV blocks and scheduled each step"),
    "waiting": ("gauge", "Sequences queued for admission (new or preempted for recompute)"),
    "swapped": ("gauge", "Preempted sequences whose KV blocks are in the host tier"),
    "kv_blocks_total": ("gauge", "Device-tier KV blocks"),
    "kv_blocks_used": ("gauge", "KV blocks referenced by sequences"),
    "kv_blocks_free": ("gauge", "KV blocks allocatable now (free or evictable cached)"),
    "kv_blocks_cached": ("gauge", "Unreferenced KV blocks kept for the prefix cache"),
    "host_kv_blocks_total": ("gauge", "Host-tier (swap) KV blocks"),
    "host_kv_blocks_free": ("gauge", "Free host-tier KV blocks"),
    "prefix_cache_hit_rate": ("gauge", "Prompt blocks found in the prefix cache / prompt blocks looked up"),
    "requests_added": ("counter", "Requests accepted"),
    "requests_finished": ("counter", "Requests finished (any reason)"),
    "requests_aborted": ("counter", "Requests cancelled"),
    "requests_failed": ("counter", "Requests that ended with an error"),
    "requests_rejected": ("counter", "Requests refused as overloaded"),
    "preemptions": ("counter", "Sequences preempted for lack of KV blocks"),
    "swap_outs": ("counter", "Preemptions that moved blocks to the host tier"),
    "prompt_tokens": ("counter", "Prompt tokens of accepted requests"),
    "cached_prompt_tokens": ("counter", "Prompt tokens whose KV came from the prefix cache at admission"),
    "computed_prefill_tokens": ("counter", "Prompt tokens computed by forward passes"),
    "recomputed_tokens": ("counter", "Generated tokens computed again after a recompute preemption"),
    "generation_tokens": ("counter", "Tokens sampled"),
    "embedding_requests": ("counter", "Sequences embedded by encoder batches"),
    "fill_mask_requests": ("counter", "Masked sequences scored by the MLM head in encoder batches"),
    "steps": ("counter", "Engine steps that ran a forward pass"),
    "step_time_seconds_total": ("counter", "Time spent in engine steps"),
    "last_step_time_seconds": ("gauge", "Duration of the latest step"),
    "last_step_tokens": ("gauge", "Tokens computed by the latest step"),
    "spec_draft_tokens": ("counter", "Tokens proposed by the speculative draft model"),
    "spec_accepted_tokens": ("counter", "Draft tokens the target model accepted"),
    "spec_acceptance_rate": ("gauge", "Accepted / proposed draft tokens"),
}


@dataclass(slots=True)
class EngineCounters:
    """What the engine counts as it runs (gauges are read from the scheduler and the pool on demand)."""

    requests_added: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    requests_failed: int = 0
    requests_rejected: int = 0
    prompt_tokens: int = 0
    computed_prefill_tokens: int = 0
    recomputed_tokens: int = 0
    generation_tokens: int = 0
    embedding_requests: int = 0
    fill_mask_requests: int = 0
    steps: int = 0
    step_time_seconds_total: float = 0.0
    last_step_time_seconds: float = 0.0
    last_step_tokens: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    def count_chunk(self, start: int, end: int, prompt_len: int, num_tokens: int) -> None:
        """Classify the tokens at positions start..end-1 computed for one sequence."""
        prefill = max(0, min(end, prompt_len) - start)
        self.computed_prefill_tokens += prefill
        # past the prompt, only the last token (the newest sample) is a plain decode; the rest is recompute
        self.recomputed_tokens += max(0, end - max(start, prompt_len) - (1 if end == num_tokens else 0))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def snapshot(counters: EngineCounters, scheduler: Any) -> dict[str, Any]:
    """Counters plus the current gauges, as one flat dict."""
    pool, cache = scheduler.pool, scheduler.cache
    out = counters.as_dict()
    out.update(running=len(scheduler.running), waiting=len(scheduler.waiting), swapped=len(scheduler.swapped),
               kv_blocks_total=pool.num_blocks, kv_blocks_used=pool.num_used, kv_blocks_free=pool.num_free,
               kv_blocks_cached=pool.num_cached, host_kv_blocks_total=cache.host_pool.num_blocks,
               host_kv_blocks_free=cache.num_free_host, prefix_cache_hit_rate=pool.hit_rate,
               preemptions=scheduler.num_preemptions, swap_outs=scheduler.num_swap_outs,
               cached_prompt_tokens=scheduler.num_cached_prompt_tokens,
               spec_acceptance_rate=counters.spec_accepted_tokens / max(1, counters.spec_draft_tokens))
    return out


def render_prometheus(metrics: dict[str, Any], prefix: str = "inferflow_", labels: dict[str, str] | None = None) -> str:
    """Prometheus text exposition format (version 0.0.4) of a metrics dict; non-numeric entries are skipped."""
    lab = ""
    if labels:
        esc = lambda v: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # noqa: E731
        lab = "{" + ",".join(f'{k}="{esc(v)}"' for k, v in sorted(labels.items())) + "}"
    lines = []
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        kind, doc = _DOC.get(name, ("gauge", name.replace("_", " ")))
        full = prefix + name + ("_total" if kind == "counter" and not name.endswith("_total") else "")
        lines += [f"# HELP {full} {doc}", f"# TYPE {full} {kind}", f"{full}{lab} {value}"]
    return "\n".join(lines) + "\n"
