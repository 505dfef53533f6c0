"""Service configuration: what ``inferflow-service`` serves and how (YAML, or Inferflow's INI via ini_config).

A refusal names the file and the key (``service.yaml: models[0].engine: unknown key(s) ...``). Relative model paths
are relative to the config file's folder; ``${config_dir}`` and ``${env:NAME}`` expand in every string value, so
API keys need not be written into the file.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine.config import EngineConfig
from ..engine.sampling_params import SamplingParams
from ..errors import InferflowError


class ServiceConfigError(InferflowError):
    """A service config file (or mapping) is malformed; the message starts with ``file: key:``."""

    def __init__(self, file: str | None, key: str, problem: str):
        self.file, self.key, self.problem = file, key, problem
        super().__init__(": ".join(p for p in (file, key, problem) if p))


@dataclass(slots=True)
class ModelConfig:
    """One served model: where it comes from, how it is loaded, and its engine and request defaults."""

    name: str
    source: str | None = None              # model folder or file; None: the embedded default model
    spec: str | None = None                # spec name or file; None: auto-detected
    dtype: str | None = None               # float32, float16, bfloat16 (default: float32 on CPU, bf16 on GPU)
    device: str | None = None              # cpu, cuda, cuda:1 ...
    quantization: str | dict | None = None  # passed to inferflow.load: a format (q4) or a per-role mapping
    overrides: dict[str, Any] = field(default_factory=dict)   # hyper-parameters by name (rope_theta: 1e6)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: dict[str, Any] = field(default_factory=dict)    # SamplingParams defaults for this model's requests
    chat_template: str | None = None       # template text, a .jinja file, or the name of one of the model's templates
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. enable_thinking: false
    decoding_strategy: Any = None          # Inferflow default for the native route (name or {"name": ...})
    prompt_template: str | None = None     # Inferflow decoder_input_template for the native route / query files
    encoder_input_template: str | None = None
    max_logprobs: int = 20                 # the largest logprobs / top_logprobs a request may ask for
    # Inferflow ``devices`` string ("0&1;2&3") or the explicit form (tensor_parallel, pipeline_stages, cpu_layers,
    # host_embeddings): inferflow/parallel/placement.py; several ranks are launched by torchrun or spawned
    placement: str | dict | None = None


@dataclass(slots=True)
class ServiceConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    models: list[ModelConfig] = field(default_factory=list)
    api_keys: list[str] = field(default_factory=list)        # empty: no authentication
    cors: dict[str, Any] | None = None                       # CORSMiddleware arguments (allow_origins, ...)
    max_body_bytes: int = 1_000_000                          # larger request bodies get 413
    max_concurrent_requests: int | None = None               # in-flight generations beyond this get 429
    retry_after: float = 1.0                                 # seconds, sent with 429 / 503
    max_tokens_limit: int | None = None                      # max_tokens above it get 400 (also the default)
    max_n: int = 128                                         # n above it gets 400
    max_stop: int = 16                                       # more stop strings get 400
    shutdown_grace: float = 30.0                             # SIGTERM: seconds in-flight requests may finish
    log_level: str = "info"
    file: str | None = None                                  # where this config came from (for messages)


_TOP_KEYS = {f.name for f in dataclasses.fields(ServiceConfig)} - {"file"}
_MODEL_KEYS = {f.name for f in dataclasses.fields(ModelConfig)}
_CORS_KEYS = {"allow_origins", "allow_methods", "allow_headers", "allow_credentials", "expose_headers",
              "allow_origin_regex", "max_age"}
_SAMPLING_KEYS = {f.name for f in dataclasses.fields(SamplingParams)}
_VAR = re.compile(r"\$\{(env:)?([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand(value: Any, variables: dict[str, str], file: str | None, key: str) -> Any:
    if isinstance(value, dict):
        return {k: _expand(v, variables, file, f"{key}.{k}" if key else str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v, variables, file, f"{key}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(1):
            if m.group(2) not in os.environ:
                raise ServiceConfigError(file, key, f"environment variable {m.group(2)} is not set")
            return os.environ[m.group(2)]
        if m.group(2) not in variables:
            raise ServiceConfigError(file, key, f"unknown variable ${{{m.group(2)}}} "
                                                f"(known: {', '.join(sorted(variables))}, env:NAME)")
        return variables[m.group(2)]

    return _VAR.sub(sub, value)


def _check_type(file: str | None, key: str, value: Any, types: tuple[type, ...], want: str) -> None:
    if value is not None and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
        raise ServiceConfigError(file, key, f"{value!r} is not {want}")


def _path(value: str | None, base: Path | None) -> str | None:
    """Relative paths are relative to the config file's folder (when something is there)."""
    if value is None or base is None or Path(value).is_absolute():
        return value
    cand = base / value
    return str(cand) if cand.exists() else value


def _refuse_unknown(d: dict, allowed: set[str], file: str | None, where: str) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ServiceConfigError(file, where, f"unknown key(s) {', '.join(unknown)}; expected some of "
                                              f"{', '.join(sorted(allowed))}")


def model_config(d: Any, file: str | None, where: str, base: Path | None) -> ModelConfig:
    """One validated model entry (``where`` names it in errors: ``models[0]``)."""
    if not isinstance(d, dict):
        raise ServiceConfigError(file, where, "expected a mapping with at least 'source' or 'name'")
    _refuse_unknown(d, _MODEL_KEYS, file, where)
    d = dict(d)
    for key in ("name", "source", "spec", "dtype", "device", "chat_template", "prompt_template",
                "encoder_input_template"):
        _check_type(file, f"{where}.{key}", d.get(key), (str,), "a string")
    _check_type(file, f"{where}.quantization", d.get("quantization"), (str, dict), "a format name or a mapping")
    for key in ("overrides", "sampling", "chat_template_kwargs", "engine"):
        _check_type(file, f"{where}.{key}", d.get(key), (dict,), "a mapping")
    _check_type(file, f"{where}.max_logprobs", d.get("max_logprobs"), (int,), "an integer")
    if d.get("placement") is not None:
        from ..parallel.placement import Placement

        if isinstance(d["placement"], int) and not isinstance(d["placement"], bool):
            d["placement"] = str(d["placement"])  # ``placement: 0`` (one GPU) parses as a number in YAML
        try:
            Placement.from_config(d["placement"])
        except InferflowError as e:
            raise ServiceConfigError(file, f"{where}.placement", str(e)) from None
    d["source"], d["spec"] = _path(d.get("source"), base), _path(d.get("spec"), base)
    if d.get("chat_template") and base is not None and d["chat_template"].endswith(".jinja"):
        path = Path(_path(d["chat_template"], base) or "")
        if not path.is_file():
            raise ServiceConfigError(file, f"{where}.chat_template", f"file {path} not found")
        d["chat_template"] = path.read_text(encoding="utf-8")
    if not d.get("name"):
        d["name"] = Path(d["source"]).stem if d.get("source") else "default"
    try:
        d["engine"] = EngineConfig.from_dict(d.get("engine"), where=f"{where}.engine")
    except InferflowError as e:
        msg = str(e).removeprefix("engine config: ")
        raise ServiceConfigError(file, "" if msg.startswith(where) else f"{where}.engine", msg) from None
    except TypeError as e:
        raise ServiceConfigError(file, f"{where}.engine", str(e)) from None
    # the speculative draft model is a path like ``source`` (the Engine loads it)
    d["engine"].speculative_model = _path(d["engine"].speculative_model, base)
    sampling = d.get("sampling") or {}
    bad = sorted(set(sampling) - _SAMPLING_KEYS)
    if bad:
        raise ServiceConfigError(file, f"{where}.sampling", f"unknown key(s) {', '.join(bad)}")
    try:
        SamplingParams(**sampling)
    except (InferflowError, TypeError) as e:
        raise ServiceConfigError(file, f"{where}.sampling", str(e).removeprefix("sampling: ")) from None
    return ModelConfig(**d)


def config_from_dict(data: Any, file: str | None = None) -> ServiceConfig:
    """Validate a parsed config mapping (the YAML document, or the INI translated to the same shape)."""
    base = Path(file).resolve().parent if file else None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ServiceConfigError(file, "", "the top level must be a mapping")
    _refuse_unknown(data, _TOP_KEYS, file, "")
    data = _expand(data, {"config_dir": str(base) if base else os.getcwd()}, file, "")
    _check_type(file, "host", data.get("host"), (str,), "a string")
    for key in ("port", "max_body_bytes", "max_concurrent_requests", "max_tokens_limit", "max_n", "max_stop"):
        _check_type(file, key, data.get(key), (int,), "an integer")
        if key != "port" and data.get(key) is not None and data[key] < 1:
            raise ServiceConfigError(file, key, f"{data[key]} is not a positive integer")
    for key in ("retry_after", "shutdown_grace"):
        _check_type(file, key, data.get(key), (int, float), "a number")
        if data.get(key) is not None and data[key] < 0:
            raise ServiceConfigError(file, key, f"{data[key]} is negative")
    port = data.get("port", 8080)
    if not 0 <= port <= 65535:
        raise ServiceConfigError(file, "port", f"{port} is not a TCP port (0..65535)")
    if data.get("max_body_bytes") is not None and data["max_body_bytes"] < 1:
        raise ServiceConfigError(file, "max_body_bytes", "must be a positive integer")
    keys = data.get("api_keys") or []
    if isinstance(keys, str):
        keys = [keys]
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        raise ServiceConfigError(file, "api_keys", "expected a list of non-empty strings")
    cors = data.get("cors")
    if cors is not None:
        if not isinstance(cors, dict):
            raise ServiceConfigError(file, "cors", "expected a mapping (allow_origins, allow_methods, ...)")
        _refuse_unknown(cors, _CORS_KEYS, file, "cors")
    models = data.get("models")
    if models is None:
        models = [{}]
    if isinstance(models, dict):  # {name: {...}} form
        models = [{"name": k, **(v or {})} for k, v in models.items()]
    if not isinstance(models, list) or not models:
        raise ServiceConfigError(file, "models", "expected a non-empty list of models")
    parsed = [model_config(m, file, f"models[{i}]", base) for i, m in enumerate(models)]
    names = [m.name for m in parsed]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ServiceConfigError(file, "models", f"duplicate model name(s) {', '.join(dup)}")
    kw = {k: data[k] for k in ("host", "port", "max_body_bytes", "max_concurrent_requests", "retry_after",
                               "log_level", "max_tokens_limit", "max_n", "max_stop", "shutdown_grace")
          if data.get(k) is not None}
    return ServiceConfig(models=parsed, api_keys=list(keys), cors=cors, file=file, **kw)


def load_service_config(path: str | os.PathLike | None = None) -> ServiceConfig:
    """Read a service config (``.yaml``/``.yml``/``.json`` or Inferflow ``.ini``); None: the default model only."""
    if path is None:
        return config_from_dict({"models": [{"name": "SmolLM2-135M-Instruct"}]})
    p = Path(path)
    if not p.is_file():
        raise ServiceConfigError(str(p), "", "file not found")
    text = p.read_text(encoding="utf-8")
    if p.suffix.lower() == ".ini":
        from .ini_config import ini_to_dict

        return config_from_dict(ini_to_dict(text, str(p)), str(p))
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ServiceConfigError(str(p), "", f"not valid YAML: {e}") from None
    return config_from_dict(data, str(p))
