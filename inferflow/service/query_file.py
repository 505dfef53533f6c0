"""``llm_inference`` query files: YAML (or JSON), or Inferflow's ``llm_inference.ini``.

YAML::

    model:                       # a service-config model entry (source, spec, dtype, device, engine, ...), plus
      source: path/to/model      #   chat: false  -> no chat template (plain text prompts)
      chat: true                 #   config: service.yaml, name: x -> take that entry of a service config instead
    sampling: {max_new_tokens: 64, temperature: 0.7, decoding_alg: sample.top_p, seed: 1}
    queries:
      - plain text
      - {text: ..., system_prompt: ..., res_prefix: ..., decoder_input_template: ..., encoder_input_template: ...}

INI (Inferflow): ``[main]`` ``inference_engine_config`` (a service ini; may be this file), ``query_list`` (a
section with ``query_count`` and ``query1..N``: text with ``{\\n}``-style escapes, or JSON objects),
``query_random_seed`` (1), ``temperature`` (0.7), and our ``max_output_len`` (300, Inferflow's fixed cap).
"""
from __future__ import annotations

import configparser
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import ModelConfig, ServiceConfigError, load_service_config, model_config
from .prompt_template import unescape

_QUERY_KEYS = {"text", "system_prompt", "res_prefix", "decoder_input_template", "encoder_input_template"}


@dataclass(slots=True)
class QueryJob:
    model: ModelConfig
    queries: list[dict[str, str]]
    sampling: dict[str, Any] = field(default_factory=dict)   # SamplingParams fields, plus decoding_alg
    chat: bool = True


def _queries(items: Any, file: str, key: str) -> list[dict[str, str]]:
    if not isinstance(items, list) or not items:
        raise ServiceConfigError(file, key, "expected a non-empty list of queries")
    out = []
    for i, q in enumerate(items):
        if isinstance(q, str):
            q = {"text": q}
        if not isinstance(q, dict) or not all(isinstance(v, str) for v in q.values()):
            raise ServiceConfigError(file, f"{key}[{i}]", "expected text or an object of strings")
        bad = sorted(set(q) - _QUERY_KEYS)
        if bad:
            raise ServiceConfigError(file, f"{key}[{i}]", f"unknown key(s) {', '.join(bad)}; expected some of "
                                                          f"{', '.join(sorted(_QUERY_KEYS))}")
        out.append(q)
    return out


def _pick(models: list[ModelConfig], name: str | None, file: str) -> ModelConfig:
    if name is None:
        return models[0]
    for m in models:
        if m.name == name:
            return m
    raise ServiceConfigError(file, "model.name", f"no model {name!r} in the service config "
                                                 f"({', '.join(m.name for m in models)})")


def _yaml_job(data: Any, file: str) -> QueryJob:
    if not isinstance(data, dict):
        raise ServiceConfigError(file, "", "a query file is a mapping with model, sampling and queries")
    bad = sorted(set(data) - {"model", "sampling", "queries"})
    if bad:
        raise ServiceConfigError(file, "", f"unknown key(s) {', '.join(bad)}; expected model, sampling, queries")
    base = Path(file).resolve().parent
    m = dict(data.get("model") or {})
    chat = m.pop("chat", True)
    if "config" in m:
        path = base / m.pop("config")
        name = m.pop("name", None)
        if m:
            raise ServiceConfigError(file, "model", f"with 'config', only 'name' and 'chat' may be given, not "
                                                    f"{', '.join(sorted(m))}")
        model = _pick(load_service_config(path).models, name, file)
    else:
        model = model_config({"name": "default", **m}, file, "model", base)
    sampling = data.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise ServiceConfigError(file, "sampling", "expected a mapping")
    return QueryJob(model, _queries(data.get("queries"), file, "queries"), dict(sampling), bool(chat))


def _ini_job(text: str, file: str) -> QueryJob:
    cp = configparser.ConfigParser(interpolation=None, comment_prefixes=(";", "#"), strict=False)
    try:
        cp.read_string(text, source=file)
    except configparser.Error as e:
        raise ServiceConfigError(file, "", f"not a valid INI file: {e}") from None
    if not cp.has_section("main"):
        raise ServiceConfigError(file, "[main]", "missing")
    main = cp["main"]
    engine_file = main.get("inference_engine_config", "").strip()
    path = (Path(file).resolve().parent / engine_file) if engine_file else Path(file)
    model = load_service_config(path).models[0]
    section = main.get("query_list", "").strip()
    if not section or not cp.has_section(section):
        raise ServiceConfigError(file, "[main] query_list", f"names no section ({section!r})")
    ql = cp[section]
    items: list[Any] = []
    for i in range(1, int(ql.get("query_count", "0")) + 1):
        raw = ql.get(f"query{i}")
        if raw is None:
            raise ServiceConfigError(file, f"[{section}] query{i}", "missing (query_count says more)")
        raw = raw.strip()
        items.append(json.loads(raw) if raw.startswith("{") else unescape(raw))
    sampling: dict[str, Any] = {"temperature": float(main.get("temperature", "0.7")),
                                "max_tokens": int(main.get("max_output_len", "300"))}
    seed = int(main.get("query_random_seed", "1"))
    if seed:
        sampling["seed"] = seed
    if main.get("decoding_alg"):
        sampling["decoding_alg"] = main["decoding_alg"].strip()
    return QueryJob(model, _queries(items, file, f"[{section}]"), sampling)


def load_query_file(path: str | Path) -> QueryJob:
    p = Path(path)
    if not p.is_file():
        raise ServiceConfigError(str(p), "", "file not found")
    text = p.read_text(encoding="utf-8")
    if p.suffix.lower() == ".ini":
        return _ini_job(text, str(p))
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ServiceConfigError(str(p), "", f"not valid YAML: {e}") from None
    return _yaml_job(data, str(p))
