"""OpenAI / vLLM request fields -> SamplingParams, with a named 400 for every invalid field.

Field names, defaults and checks follow vLLM's ``protocol.py`` (see shared/reference/serving.md §2-§3). Unknown
fields are accepted and ignored, as vLLM and OpenAI do. Per-model defaults (the service config's ``sampling``)
apply to fields the request leaves out.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..engine.sampling_params import SamplingParams
from ..errors import InferflowError
from .errors import APIError, bad_request
from .guided import check_params, guided_fields

_INT64 = 2 ** 63
_NUM = (int, float)

# request field -> (SamplingParams field, accepted types, description of a valid value)
SAMPLING_FIELDS: dict[str, tuple[str, tuple[type, ...], str]] = {
    "n": ("n", (int,), "an integer >= 1"),
    "temperature": ("temperature", _NUM, "a number >= 0"),
    "top_p": ("top_p", _NUM, "a number in (0, 1]"),
    "top_k": ("top_k", (int,), "-1, 0 (off) or a positive integer"),
    "min_p": ("min_p", _NUM, "a number in [0, 1]"),
    "typical_p": ("typical_p", _NUM, "a number in (0, 1]"),
    "tfs_z": ("tfs_z", _NUM, "a number in (0, 1]"),
    "mirostat": ("mirostat", (int,), "0 or 2"),
    "mirostat_tau": ("mirostat_tau", _NUM, "a number"),
    "mirostat_eta": ("mirostat_eta", _NUM, "a number"),
    "repetition_penalty": ("repetition_penalty", _NUM, "a number > 0"),
    "presence_penalty": ("presence_penalty", _NUM, "a number in [-2, 2]"),
    "frequency_penalty": ("frequency_penalty", _NUM, "a number in [-2, 2]"),
    "min_tokens": ("min_tokens", (int,), "an integer >= 0"),
    "ignore_eos": ("ignore_eos", (bool,), "a boolean"),
    "stop_token_ids": ("stop_token_ids", (list,), "a list of token ids"),
    "include_stop_str_in_output": ("include_stop_str_in_output", (bool,), "a boolean"),
    "skip_special_tokens": ("skip_special_tokens", (bool,), "a boolean"),
    "allowed_token_ids": ("allowed_token_ids", (list,), "a list of token ids"),
    "eos_bypass_max": ("eos_bypass_max", (int,), "an integer >= 0"),
    "fsd_alpha": ("fsd_alpha", _NUM, "a number in [0, 1]"),
    "fsd_k": ("fsd_k", (int,), "a positive integer"),
    "fsd_n": ("fsd_n", (int,), "a positive integer"),
    "fsd_beta": ("fsd_beta", _NUM, "a number"),
    "length_penalty": ("length_penalty", _NUM, "a number"),
}
_SAMPLING_ERROR = re.compile(r"^sampling: (\w+) = ")


def check_type(body: dict[str, Any], name: str, types: tuple[type, ...], want: str) -> Any:
    """The field's value (None when absent or null); 400 naming the field when its type is wrong."""
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        raise bad_request(f"{value!r} is not {want}", name)
    return value


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise bad_request("must be a string or a list of strings", "stop")


def _logit_bias(body: dict[str, Any], vocab_size: int) -> dict[int, float]:
    bias = check_type(body, "logit_bias", (dict,), "an object mapping token ids to biases")
    out = {}
    for k, v in (bias or {}).items():
        try:
            tok = int(k)
        except (TypeError, ValueError):
            raise bad_request(f"key {k!r} is not a token id", "logit_bias") from None
        if not 0 <= tok < vocab_size:
            raise bad_request(f"token id {tok} is outside the vocabulary (0..{vocab_size - 1})", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, _NUM) or not -100 <= v <= 100:
            raise bad_request(f"bias {v!r} for token {tok} is not a number in [-100, 100]", "logit_bias")
        out[tok] = float(v)
    return out


def _token_list(body: dict[str, Any], name: str, vocab_size: int) -> None:
    ids = body.get(name)
    if ids is None:
        return
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise bad_request(f"every entry must be a token id in 0..{vocab_size - 1}", name)


def sampling_params(body: dict[str, Any], defaults: dict[str, Any], vocab_size: int, *, max_tokens_field: str,
                    default_max_tokens: int | None, limits: Any = None) -> SamplingParams:
    """SamplingParams from a request body on top of the model's defaults (max_tokens is settled separately).

    ``limits`` (the ServiceConfig) caps ``max_tokens`` (``max_tokens_limit``: also the default when the request
    leaves it out), ``n`` (``max_n``) and the number of stop strings (``max_stop``); beyond a cap is a named 400."""
    kw: dict[str, Any] = {k: v for k, v in defaults.items()}
    for name, (target, types, want) in SAMPLING_FIELDS.items():
        value = check_type(body, name, types, want)
        if value is not None:
            kw[target] = value
    _token_list(body, "stop_token_ids", vocab_size)
    _token_list(body, "allowed_token_ids", vocab_size)
    seed = check_type(body, "seed", (int,), "an integer")
    if seed is not None:
        if not -_INT64 <= seed < _INT64:
            raise bad_request("must fit in a signed 64-bit integer", "seed")
        kw["seed"] = seed
    stop = _stop(body)
    max_stop = getattr(limits, "max_stop", None)
    if max_stop is not None and len(stop) > max_stop:
        raise bad_request(f"{len(stop)} stop strings are more than this server's maximum of {max_stop}", "stop")
    if stop:
        kw["stop"] = stop
    bias = _logit_bias(body, vocab_size)
    if bias:
        kw["logit_bias"] = bias
    mt = check_type(body, max_tokens_field, (int,), "an integer >= 1")
    if mt is None and max_tokens_field != "max_tokens":
        mt = check_type(body, "max_tokens", (int,), "an integer >= 1")
    if mt is not None and mt < 1:
        raise bad_request(f"{mt} is not an integer >= 1", max_tokens_field)
    kw["max_tokens"] = mt if mt is not None else kw.get("max_tokens", default_max_tokens)
    cap = getattr(limits, "max_tokens_limit", None)
    if cap is not None:
        if mt is not None and mt > cap:
            raise bad_request(f"{mt} is more than this server's maximum of {cap} tokens", max_tokens_field)
        kw["max_tokens"] = cap if kw["max_tokens"] is None else min(kw["max_tokens"], cap)
    max_n = getattr(limits, "max_n", None) or 128
    if kw.get("n", 1) > max_n:
        raise bad_request(f"{kw['n']} is more than this server's maximum of {max_n}", "n")
    best_of = check_type(body, "best_of", (int,), "an integer")
    if best_of is not None and best_of != kw.get("n", 1):
        raise bad_request("best_of other than n is not supported", "best_of")
    if body.get("use_beam_search"):
        raise bad_request("beam search is not supported by this server", "use_beam_search")
    if body.get("prompt_logprobs") is not None:
        raise bad_request("prompt_logprobs are not supported by this server", "prompt_logprobs")
    kw.update(guided_fields(body))  # guided_json / guided_choice
    try:
        sp = SamplingParams(**kw)
    except InferflowError as e:
        m = _SAMPLING_ERROR.match(str(e))
        name = m.group(1) if m else None
        raise bad_request(str(e).removeprefix("sampling: "), name) from None
    check_params(sp)
    return sp


@dataclass(slots=True)
class StreamOptions:
    stream: bool = False
    include_usage: bool = False
    continuous_usage_stats: bool = False


def stream_options(body: dict[str, Any]) -> StreamOptions:
    stream = bool(check_type(body, "stream", (bool,), "a boolean"))
    opts = check_type(body, "stream_options", (dict,), "an object")
    if opts is not None and not stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    opts = opts or {}
    inc = check_type(opts, "include_usage", (bool,), "a boolean")
    cont = check_type(opts, "continuous_usage_stats", (bool,), "a boolean")
    return StreamOptions(stream, bool(inc), bool(cont))


def check_logprobs(sp: SamplingParams, max_logprobs: int, name: str) -> None:
    if sp.logprobs is not None and sp.logprobs > max_logprobs:
        raise bad_request(f"{sp.logprobs} is more than this server's maximum of {max_logprobs}", name)


@dataclass(slots=True)
class Prompt:
    """A prompt ready for the engine (token ids) and what its usage / echo needs."""

    ids: list[int]
    text: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def model_name(body: dict[str, Any], served: list[str]) -> str:
    """The requested model; with one served model, a missing ``model`` means that one."""
    name = body.get("model")
    if name is None:
        if len(served) == 1:
            return served[0]
        raise bad_request("is required (this server serves several models)", "model")
    if not isinstance(name, str):
        raise bad_request(f"{name!r} is not a string", "model")
    return name


def require_json_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_request")
    return body
