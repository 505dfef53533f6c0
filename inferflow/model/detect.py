"""Opening a model source and choosing the spec that matches it."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import FormatError, SpecError
from ..loaders.hf import HFDirSource
from ..loaders.source import WeightSource
from ..spec.expr import resolve
from ..spec.loader import Spec, all_specs, load_spec, search_path


def open_source(source: str | os.PathLike) -> WeightSource:
    """Pick a loader by what ``source`` is (a folder with config.json, a file of a known format)."""
    p = Path(source)
    if p.is_dir():
        from ..loaders import open_folder  # safetensors, else pytorch_model*.bin pickles

        return open_folder(p)
    if not p.exists():
        raise FormatError(str(p), "no such file or folder")
    from ..spec.inferflow_compat import open_model, read_inferflow_spec

    if read_inferflow_spec(p) is not None:  # an Inferflow model_spec.json: the weights it names, its spec translated
        return open_model(p)
    from ..loaders import open_file  # file formats (GGUF, pickle, llama2.c) register there

    return open_file(p)


def match_spec(src: WeightSource) -> Spec:
    """The spec whose ``match`` section fits the source's config (HF model_type or GGUF architecture)."""
    cfg = src.config
    candidates = []
    broken: list[SpecError] = []
    for spec in all_specs(broken):
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
            # Specs extending llama inherit `llama2c: true`; the loader's config says model_type "llama".
            types = m.get("hf_model_type", [])
            types = [types] if isinstance(types, str) else types
            if not m.get("llama2c") or cfg.get("model_type") not in types:
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
        dirs = ", ".join(map(str, search_path())) or "(none)"
        note = "".join(f"; skipped broken spec {e}" for e in broken)
        raise SpecError(src.path, None, f"no spec in {dirs} matches {what}; pass spec=NAME_OR_PATH or add a spec "
                                        f"file there (or in a folder on $INFERFLOW_SPEC_PATH){note}")
    candidates.sort(key=lambda c: -c[0])
    return candidates[0][1]


def resolve_spec(spec: str | os.PathLike | Spec | None, src: WeightSource) -> Spec:
    if isinstance(spec, Spec):
        return spec
    if spec is None:
        return getattr(src, "translated_spec", None) or match_spec(src)
    from ..spec.inferflow_compat import read_inferflow_spec, translate

    doc = read_inferflow_spec(spec) if str(spec).endswith(".json") else None
    return translate(doc, spec, src) if doc is not None else load_spec(spec)
