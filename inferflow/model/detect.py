"""Opening a model source and choosing the spec that matches it."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import FormatError, SpecError
from ..loaders.source import WeightSource
from ..spec.expr import resolve
from ..spec.loader import Spec, checked, load_spec, read_spec, search_path, spec_files


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
    """The spec whose ``match`` section fits the source's config (HF model_type or GGUF architecture): of the
    valid specs, the first on the search path of each name, the fitting one of highest priority (then path order).

    Specs are read unchecked and only the candidates are schema-checked, best first (the schema costs ~5 ms a
    spec, so checking all of them was most of detection): a broken one is skipped as if it had failed to load,
    and named in the error if nothing matches."""
    cfg = src.config
    parsed: list[Spec] = []
    broken: list[SpecError] = []
    for p in spec_files():
        try:
            parsed.append(read_spec(p))
        except SpecError as e:
            broken.append(e)
    valid: dict[int, bool] = {}

    def ok(i: int) -> bool:
        if i not in valid:
            try:
                checked(parsed[i])
                valid[i] = True
            except SpecError as e:
                broken.append(e)
                valid[i] = False
        return valid[i]

    fitting = [i for i, spec in enumerate(parsed) if _fits(spec, src, cfg)]
    for i in sorted(fitting, key=lambda i: -_priority(parsed[i])):  # stable: path order among equals
        shadowed = any(parsed[j].name == parsed[i].name and ok(j) for j in range(i))
        if not shadowed and ok(i):
            return parsed[i]
    for i in range(len(parsed)):  # the error names every broken spec on the path, not only the fitting ones
        ok(i)
    what = {"hf": f"model_type {cfg.get('model_type')!r}", "gguf": f"general.architecture {src.arch!r}"}.get(
        src.kind, src.kind)
    dirs = ", ".join(map(str, search_path())) or "(none)"
    note = "".join(f"; skipped broken spec {e}" for e in broken)
    raise SpecError(src.path, None, f"no spec in {dirs} matches {what}; pass spec=NAME_OR_PATH or add a spec "
                                    f"file there (or in a folder on $INFERFLOW_SPEC_PATH){note}")


def _priority(spec: Spec) -> float:
    m = spec.data.get("match")
    p = m.get("priority", 0) if isinstance(m, dict) else 0
    return p if isinstance(p, (int, float)) else 0


def _listed(value: Any, want: Any) -> bool:
    return want in ([value] if isinstance(value, str) else value if isinstance(value, list) else [])


def _fits(spec: Spec, src: WeightSource, cfg: dict) -> bool:
    """Whether ``spec``'s ``match`` section accepts the source: its kind's keys, then ``when``. A malformed
    section counts as fitting, so that the schema check says what is wrong with it."""
    try:
        return _accepts(spec, spec.data.get("match", {}), src, cfg)
    except (TypeError, AttributeError, ValueError, KeyError):
        return True


def _accepts(spec: Spec, m: Any, src: WeightSource, cfg: dict) -> bool:
    if not isinstance(m, dict):
        return True
    if src.kind == "hf" and not _listed(m.get("hf_model_type", []), cfg.get("model_type")):
        return False
    if src.kind == "gguf" and not _listed(m.get("gguf_architecture", []), src.arch):
        return False
    # Specs extending llama inherit `llama2c: true`; the loader's config says model_type "llama".
    if src.kind == "llama2c" and not (m.get("llama2c") and _listed(m.get("hf_model_type", []), cfg.get("model_type"))):
        return False
    if "when" in m:
        names = {k: v for k, v in cfg.items() if isinstance(k, str) and k.isidentifier()}
        names.setdefault("config", cfg)
        try:
            return bool(resolve(m["when"], names, where=(spec.file, "match.when")))
        except SpecError:
            return False
    return True


def resolve_spec(spec: str | os.PathLike | Spec | None, src: WeightSource) -> Spec:
    if isinstance(spec, Spec):
        return spec
    if spec is None:
        return getattr(src, "translated_spec", None) or match_spec(src)
    from ..spec.inferflow_compat import read_inferflow_spec, translate

    doc = read_inferflow_spec(spec) if str(spec).endswith(".json") else None
    return translate(doc, spec, src) if doc is not None else load_spec(spec)
