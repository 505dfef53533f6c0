"""Opening a model source and choosing the spec that matches it."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import FormatError, SpecError
from ..loaders.hf import HFDirSource
from ..loaders.source import WeightSource
from ..spec.expr import resolve
from ..spec.loader import Spec, all_specs, load_spec


def open_source(source: str | os.PathLike) -> WeightSource:
    """Pick a loader by what ``source`` is (a folder with config.json, a file of a known format)."""
    p = Path(source)
    if p.is_dir():
        return HFDirSource(p)
    if not p.exists():
        raise FormatError(str(p), "no such file or folder")
    from ..loaders import open_file  # file formats (GGUF, pickle, llama2.c) register there

    return open_file(p)


def match_spec(src: WeightSource) -> Spec:
    """The spec whose ``match`` section fits the source's config (HF model_type or GGUF architecture)."""
    cfg = src.config
    candidates = []
    for spec in all_specs():
        m = spec.data.get("match", {})
        if src.kind == "hf":
            types = m.get("hf_model_type", [])
            types = [types] if isinstance(types, str) else types
            if cfg.get("model_type") not in types:
                continue
        elif src.kind == "gguf":
            archs = m.get("gguf_architecture", [])
            archs = [archs] if isinstance(archs, str) else archs
            if src.arch not in archs:
                continue
        elif src.kind == "llama2c":
            if not m.get("llama2c"):
                continue
        if "when" in m:
            names = {k: v for k, v in cfg.items() if isinstance(k, str) and k.isidentifier()}
            names.setdefault("config", cfg)
            try:
                if not resolve(m["when"], names, where=(spec.file, "match.when")):
                    continue
            except SpecError:
                continue
        candidates.append((m.get("priority", 0), spec))
    if not candidates:
        what = {"hf": f"model_type {cfg.get('model_type')!r}", "gguf": f"general.architecture {src.arch!r}"}.get(
            src.kind, src.kind)
        raise SpecError(src.path, None, f"no spec in {', '.join(s.file for s in [])or 'model_specs'} matches {what}; "
                                        f"pass spec=NAME_OR_PATH or add a spec file")
    candidates.sort(key=lambda c: -c[0])
    return candidates[0][1]


def resolve_spec(spec: str | os.PathLike | Spec | None, src: WeightSource) -> Spec:
    if isinstance(spec, Spec):
        return spec
    return load_spec(spec) if spec is not None else match_spec(src)
