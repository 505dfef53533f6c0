"""Inferflow's decoding strategy names (``decoding_alg`` / ``decoding_strategy``) as SamplingParams.

Defaults are Inferflow's compiled ones (shared/reference/inferflow.md §6). The ``sample.std`` family keeps the top
``max_k`` tokens within the top-p nucleus (Inferflow cuts the nucleus to ``max_k`` after top-p; the sampler here
applies top-k before top-p, which keeps the same tokens whenever the nucleus holds ``max_k`` or fewer). Unlike
Inferflow, the other strategies' parameters can be set too, and an unknown name is refused rather than silently
replaced by ``sample.std``.
"""
from __future__ import annotations

import json
from typing import Any

from ..errors import InferflowError

_STD = {"top_p": 0.9, "top_k": 8}
STRATEGIES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "sample.std": _STD,
    "top_p": _STD,
    "top_k": {"top_p": 1.0, "top_k": 8},
    "fsd": {"fsd_alpha": 0.5, "fsd_k": 6, "fsd_n": 3, "fsd_beta": 0.9},
    # Inferflow mixes FSD and sampling for the first 10 tokens; here: FSD candidates drawn with top-p/top-k noise
    "random_fsd": {"fsd_alpha": 0.5, "fsd_k": 6, "fsd_n": 3, "fsd_beta": 0.9, "top_p": 0.93, "top_k": 8},
    "min_p": {"min_p": 0.05, "top_k": 50},
    "tfs": {"tfs_z": 0.95},
    "typical": {"typical_p": 0.95},
    "mirostat": {"mirostat": 2, "mirostat_tau": 5.0, "mirostat_eta": 0.1},
}
# JSON strategy keys (Inferflow's names) -> SamplingParams fields
_JSON_KEYS = {"top_p": "top_p", "max_k": "top_k", "eos_bypassing_max": "eos_bypass_max", "k": "fsd_k",
              "alpha": "fsd_alpha", "n": "fsd_n", "beta": "fsd_beta", "min_p": "min_p", "z": "tfs_z",
              "p": "typical_p", "eta": "mirostat_eta", "tau": "mirostat_tau"}
_IGNORED_KEYS = {"name", "min_k", "pool_size"}


def canonical(name: str) -> str:
    """``sample.top_p`` -> ``top_p``: Inferflow accepts each name with and without the ``sample.`` prefix."""
    name = name.strip()
    if name.startswith("sample.") and name != "sample.std":
        name = name[len("sample."):]
    return name


def strategy_params(strategy: Any) -> dict[str, Any]:
    """SamplingParams keyword arguments for a strategy: a name, a JSON string or a mapping with ``name``."""
    if strategy is None or strategy == "":
        return {}
    if isinstance(strategy, str) and strategy.strip().startswith("{"):
        try:
            strategy = json.loads(strategy)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, over-long integers, absurd nesting
            raise InferflowError(f"decoding_alg: not valid JSON: {type(e).__name__}: {e}") from None
    extra: dict[str, Any] = {}
    if isinstance(strategy, dict):
        name = strategy.get("name", "sample.std")
        for k, v in strategy.items():
            if k in _JSON_KEYS:
                extra[_JSON_KEYS[k]] = v
            elif k not in _IGNORED_KEYS:
                raise InferflowError(f"decoding_alg: unknown parameter {k!r} (known: {', '.join(sorted(_JSON_KEYS))})")
    elif isinstance(strategy, str):
        name = strategy
    else:
        raise InferflowError(f"decoding_alg: {strategy!r} is neither a strategy name nor an object")
    if not isinstance(name, str) or canonical(name) not in STRATEGIES:
        names = ", ".join(sorted(STRATEGIES))
        raise InferflowError(f"decoding_alg: unknown strategy {name!r}; known: {names} (each also as sample.<name>)")
    return {**STRATEGIES[canonical(name)], **extra}
