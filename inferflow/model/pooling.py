"""Sentence-embedding pooling settings: the model folder's sentence-transformers config, else the spec's."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# sentence-transformers 1_Pooling/config.json flags -> our pooling modes (first true flag wins)
_ST_MODES = (("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
             ("pooling_mode_max_tokens", "max"), ("pooling_mode_lasttoken", "last"))


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def sentence_transformers_pooling(folder: str | Path) -> dict[str, Any] | None:
    """``{mode, normalize}`` from ``modules.json`` + its Pooling module config, or None when the folder has none.

    The checkpoint's own pooling is what its embeddings were trained with, so it wins over the spec's default.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return None
    modules = _read(folder / "modules.json")
    if not isinstance(modules, list):
        return None
    types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    pool_mod = types.get("Pooling")
    if pool_mod is None:
        return None
    cfg = _read(folder / str(pool_mod.get("path", "1_Pooling")) / "config.json")
    if not isinstance(cfg, dict):
        return None
    mode = next((m for key, m in _ST_MODES if cfg.get(key)), None)
    if mode is None:
        return None  # e.g. mean_sqrt_len or weighted modes: leave it to the spec
    return {"mode": mode, "normalize": "Normalize" in types}


def pool_hidden(hidden: torch.Tensor, lens: list[int], pool: dict[str, Any]) -> torch.Tensor:
    """Packed last hidden states [N, H] of ``len(lens)`` sequences -> pooled [n, H] (L2-normalised unless
    ``pool["normalize"]`` is false); modes mean, cls, last, max. Model.embed and the engine share it."""
    parts = torch.split(hidden, list(lens))
    mode = pool.get("mode", "mean")
    if mode == "mean":
        out = torch.stack([p.mean(0) for p in parts])
    elif mode == "cls":
        out = torch.stack([p[0] for p in parts])
    elif mode == "last":
        out = torch.stack([p[-1] for p in parts])
    else:
        out = torch.stack([p.amax(0) for p in parts])
    return F.normalize(out, dim=-1) if pool.get("normalize", True) else out


def pooling_for(source: Any, spec_pooling: dict[str, Any] | None) -> dict[str, Any]:
    """The pooling to use: the source folder's sentence-transformers config, then the spec, then mean + L2."""
    found = sentence_transformers_pooling(getattr(source, "path", "") or "")
    return found or spec_pooling or {"mode": "mean", "normalize": True}
