"""Inferflow's ``inferflow_service.ini`` translated into the YAML config's shape.

Sections: ``[main]`` (``http_port``, plus our ``host``, ``api_keys``, ``max_body_bytes``, ``max_concurrent_requests``,
``retry_after``, ``cors_allow_origins``), ``[transformer_engine]`` (``models``: every listed model is served,
``devices``, ``max_concurrent_queries``), ``[model.<name>]`` (Inferflow keys, plus ``engine.<key>``,
``sampling.<key>``, ``overrides.<key>`` and our model keys), ``[prompt_templates]`` / ``[prompt_template.<name>]``.
Knobs Inferflow has but inferflow does not need (thread counts, study mode) are accepted and ignored. Macros:
``${global_model_dir}``, ``${model_name}``, ``${config_dir}``, ``${env:NAME}``. A ``model_spec_file`` without a
folder is looked up in the model's folder (Inferflow's ``model_spec.json`` layout).
"""
from __future__ import annotations

import configparser
from pathlib import Path
from typing import Any

import yaml

from .config import ServiceConfigError

_IGNORED = {"worker_count", "is_study_mode", "cpu_layer_count", "encoder_cpu_layer_count", "decoder_cpu_layer_count",
            "cpu_threads", "return_output_tensors", "show_tensors", "multi_gpu_strategy", "default_prompt_template",
            "tensor_quant_threshold", "delta_tensor_ratio", "host_weight_data_type", "host_kv_cache_data_type",
            "global_model_dir",
            # llm_inference.ini keys, when the query file is also the engine config
            "inference_engine_config", "query_list", "query_random_seed", "temperature", "long_context_test",
            "max_output_len", "decoding_alg"}
_WEIGHT_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
_KV_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "q8": "int8", "fp8": "fp8"}
_MAIN_KEYS = {"http_port": "port", "port": "port", "host": "host", "max_body_bytes": "max_body_bytes",
              "max_concurrent_requests": "max_concurrent_requests", "retry_after": "retry_after",
              "log_level": "log_level"}
_MODEL_PLAIN = {"model_dir": "source", "source": "source", "model_specification_file": "spec",
                "model_spec_file": "spec", "spec": "spec", "dtype": "dtype", "device": "device",
                "quantization": "quantization", "chat_template": "chat_template",
                "decoding_strategy": "decoding_strategy", "prompt_template": "prompt_template",
                "decoder_input_template": "prompt_template", "encoder_input_template": "encoder_input_template",
                "max_logprobs": "max_logprobs"}


def _value(text: str) -> Any:
    """Typed value of an ini string (numbers, booleans, JSON/YAML lists); anything else stays text."""
    try:
        v = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return v if isinstance(v, (int, float, bool, list, dict)) or v is None else text


def _list(text: str) -> list[str]:
    return [p.strip() for p in text.replace(";", ",").split(",") if p.strip()]


def _device(raw: str, file: str, where: str) -> str:
    """Inferflow names GPUs by number (``0``); several devices (``0;1``, ``0&1``) are not served by one engine."""
    v = raw.strip()
    if any(c in v for c in ";,&|"):
        raise ServiceConfigError(file, where, f"{v!r}: multi-device placement is not supported; name one device")
    return f"cuda:{v}" if v.isdigit() else v or "cpu"


def _templates(cp: configparser.ConfigParser) -> dict[str, str]:
    """Named templates: each ``[prompt_template.<name>]`` has ``line_count`` and ``line1..N`` (concatenated)."""
    out = {}
    for sec in cp.sections():
        if sec.startswith("prompt_template."):
            s = cp[sec]
            n = int(s.get("line_count", "0"))
            out[sec.split(".", 1)[1]] = "".join(s.get(f"line{i}", "") for i in range(1, n + 1))
    return out


def _model(cp: configparser.ConfigParser, name: str, file: str, defaults: dict[str, Any],
           templates: dict[str, str]) -> dict[str, Any]:
    sec = f"model.{name}"
    if not cp.has_section(sec):
        raise ServiceConfigError(file, "transformer_engine.models", f"model {name!r} has no [{sec}] section")
    m: dict[str, Any] = {"name": name, "engine": dict(defaults.get("engine", {}))}
    if defaults.get("device"):
        m["device"] = defaults["device"]
    if defaults.get("placement"):
        m["placement"] = defaults["placement"]
    for key, raw in cp[sec].items():
        where = f"[{sec}] {key}"
        if key in _IGNORED:
            continue
        head, _, tail = key.partition(".")
        if tail and head in ("engine", "sampling", "overrides", "chat_template_kwargs"):
            m.setdefault(head, {})[tail] = _value(raw)
        elif key == "device_weight_data_type":
            low = raw.strip().lower()
            if low in _WEIGHT_DTYPES:
                m["dtype"] = _WEIGHT_DTYPES[low]
            else:
                m["quantization"] = low
        elif key == "device_kv_cache_data_type":
            low = raw.strip().lower()
            if low not in _KV_DTYPES:
                raise ServiceConfigError(file, where, f"{raw!r} is not one of {', '.join(k.upper() for k in _KV_DTYPES)}")
            m["engine"]["kv_cache_dtype"] = _KV_DTYPES[low]
        elif key == "host_kv_cache_percent":
            m["engine"]["host_kv_layers"] = float(raw) / 100.0
        elif key == "be_host_embeddings":
            m["engine"]["host_embeddings"] = bool(_value(raw))
        elif key == "max_context_len":
            n = int(raw)
            m["engine"]["max_model_len"] = n if n > 0 else None
        elif key == "devices" and any(c in raw for c in ";&"):
            m["placement"] = raw.strip()  # several GPUs: a pipeline / tensor-parallel placement (inferflow.parallel)
        elif key == "devices":
            m["device"] = _device(raw, file, where)
        elif key in _MODEL_PLAIN:
            m[_MODEL_PLAIN[key]] = _value(raw) if key in ("decoding_strategy", "max_logprobs") else raw.strip()
        else:
            raise ServiceConfigError(file, where, "unknown key")
    spec, source = m.get("spec"), m.get("source")
    if spec and source and not Path(spec).is_absolute() and "/" not in spec and "\\" not in spec:
        # Inferflow names the spec file inside the model folder (model_spec.json), translated on load
        cand = Path(source) / spec
        if cand.exists() or spec.endswith(".json"):
            m["spec"] = str(cand)
    for key in ("prompt_template", "encoder_input_template"):
        if m.get(key) and "{" not in m[key]:
            if m[key] not in templates:
                raise ServiceConfigError(file, f"[{sec}] {key}", f"no [prompt_template.{m[key]}] section")
            m[key] = templates[m[key]]
    return m


def ini_to_dict(text: str, file: str) -> dict[str, Any]:
    cp = configparser.ConfigParser(interpolation=None, comment_prefixes=(";", "#"), inline_comment_prefixes=None,
                                   strict=False)
    try:
        cp.read_string(text, source=file)
    except configparser.Error as e:
        raise ServiceConfigError(file, "", f"not a valid INI file: {e}") from None
    # Inferflow's macros: ${global_model_dir} ([main]) and ${model_name} (the [model.<name>] section's name)
    gmd = cp.get("main", "global_model_dir", fallback=None)
    for sec in cp.sections():
        for key, raw in cp[sec].items():
            new = raw.replace("${model_name}", sec[6:]) if sec.startswith("model.") else raw
            if gmd is not None:
                new = new.replace("${global_model_dir}", gmd)
            if new != raw:
                cp[sec][key] = new
    out: dict[str, Any] = {}
    if cp.has_section("main"):
        for key, raw in cp["main"].items():
            if key in _IGNORED:
                continue
            if key in _MAIN_KEYS:
                out[_MAIN_KEYS[key]] = _value(raw)
            elif key == "api_keys":
                out["api_keys"] = _list(raw)
            elif key.startswith("cors_"):
                v = _value(raw)
                out.setdefault("cors", {})[key[5:]] = _list(raw) if key.endswith(("origins", "methods", "headers")) else v
            else:
                raise ServiceConfigError(file, f"[main] {key}", "unknown key")
    eng = cp["transformer_engine"] if cp.has_section("transformer_engine") else {}
    defaults: dict[str, Any] = {"engine": {}}
    names: list[str] = []
    for key, raw in (eng.items() if eng else []):
        if key in _IGNORED:
            continue
        if key == "models":
            names = _list(raw)
        elif key == "devices" and any(c in raw for c in ";&"):
            defaults["placement"] = raw.strip()  # several GPUs: a parallel placement (inferflow.parallel)
        elif key == "devices":
            defaults["device"] = _device(raw, file, f"[transformer_engine] {key}")
        elif key == "max_concurrent_queries":
            defaults["engine"]["max_num_seqs"] = int(raw)
        elif key.startswith("engine."):
            defaults["engine"][key[7:]] = _value(raw)
        else:
            raise ServiceConfigError(file, f"[transformer_engine] {key}", "unknown key")
    if not names:
        raise ServiceConfigError(file, "[transformer_engine] models", "list at least one model name")
    templates = _templates(cp)
    out["models"] = [_model(cp, n, file, defaults, templates) for n in names]
    return out
