"""Inferflow's native route, ``POST /``: ``{text, system_prompt, res_prefix, decoding_alg, ...}`` in,
``{text, ret_code, error_text, time_cost, is_end}`` out; streamed as newline-delimited JSON chunks.

Compatible with Inferflow clients (``is_streaming_mode`` defaults to true, ``random_seed`` 0 means unseeded,
``max_output_len`` / ``max_new_tokens`` default 1024 and stop at the context end), with the fixes of
shared/reference/inferflow.md §13: a prompt longer than the context is an error (``error.too_long_request``), a full
server answers ``error.busy`` with Retry-After, an unknown strategy is refused, and ``header.fn = get_stat``
returns the engine's metrics. Each chunk holds whole characters (the engine never splits a UTF-8 character).
"""
from __future__ import annotations

import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.sampling_params import SamplingParams
from ..errors import InferflowError
from .decoding_alg import strategy_params
from .errors import APIError
from .framing import NDJSON_MEDIA_TYPE, CancellingStream, Utf8Guard, ndjson_line
from .generation import Generation
from .prompt_template import render_template
from .state import read_json

# HTTP status -> Inferflow ret_code
_RET_CODES = {400: "error.invalid_request_format", 401: "error.unauthorized", 404: "error.invalid_request_format",
              413: "error.too_long_request", 429: "error.busy", 503: "error.busy"}


def _native_error(e: APIError) -> JSONResponse:
    code = e.code if e.code and e.code.startswith("error.") else _RET_CODES.get(e.status, "error.processing")
    return JSONResponse({"text": "", "ret_code": code, "error_text": e.message, "time_cost": 0.0, "is_end": 1},
                        status_code=e.status, headers=e.headers())


def _fail(message: str, code: str = "error.invalid_request_format", status: int = 400) -> APIError:
    return APIError(status, message, code=code)


def _str(body: dict[str, Any], key: str) -> str:
    v = body.get(key, "")
    if v is None:
        return ""
    if not isinstance(v, str):
        raise _fail(f"{key}: {v!r} is not a string")
    return v


def _int(body: dict[str, Any], key: str, default: int | None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise _fail(f"{key}: {v!r} is not an integer")
    return int(v)


def native_prompt(served: Any, body: dict[str, Any], use_chat: bool = True) -> tuple[list[int], list[int] | None]:
    """(decoder prompt ids, encoder prompt ids or None) from Inferflow's fields, templates and (unless
    ``use_chat`` is false) the model's chat template; without either, the plain text with special tokens."""
    text, system, prefix = _str(body, "text"), _str(body, "system_prompt"), _str(body, "res_prefix")
    tok = served.need_tokenizer()
    cfg = served.model.config if isinstance(served.model.config, dict) else {}
    dec_t = _str(body, "decoder_input_template") or served.cfg.prompt_template
    enc_t = _str(body, "encoder_input_template") or served.cfg.encoder_input_template
    encoder = None
    if served.architecture == "encoder_decoder":
        encoder = render_template(enc_t, tok, query=text, system_prompt=system, config=cfg) if enc_t \
            else tok.encode(text)
        if dec_t:
            return render_template(dec_t, tok, query=text, system_prompt=system, res_prefix=prefix, config=cfg), encoder
        return (tok.encode(prefix, add_special_tokens=False) if prefix else []), encoder
    if dec_t:
        return render_template(dec_t, tok, query=text, system_prompt=system, res_prefix=prefix, config=cfg), None
    if use_chat and (getattr(tok, "chat_template", None) or served.cfg.chat_template
                     or getattr(tok, "chat_templates", None)):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        rendered = served.render_chat(messages) + prefix
        return tok.encode(rendered, add_special_tokens=False), None
    return tok.encode(system + text + prefix), None


def native_params(served: Any, body: dict[str, Any], prompt_len: int) -> SamplingParams:
    """SamplingParams from decoding_alg (else the model's decoding_strategy), temperature, random_seed, lengths."""
    alg = body.get("decoding_alg") or served.cfg.decoding_strategy
    try:
        kw = {**served.cfg.sampling, **strategy_params(alg)}
    except InferflowError as e:
        raise _fail(str(e)) from None
    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not -1e9 < temperature < 1e9:
            raise _fail(f"temperature: {temperature!r:.40} is not a finite number")  # float(10**400) would overflow
        if kw.get("temperature", 1.0) != 0.0:  # greedy stays greedy whatever the temperature
            kw["temperature"] = 0.0 if temperature < 0.001 else float(temperature)
    seed = _int(body, "random_seed", 0)
    if seed and not -(2 ** 63) <= seed < 2 ** 63:  # torch generators take 64-bit seeds: larger ones fail later
        raise _fail(f"random_seed: {seed} does not fit in a signed 64-bit integer")
    if seed:
        kw["seed"] = seed
    asked = _int(body, "max_output_len", None)
    asked = _int(body, "max_new_tokens", asked if asked is not None else 1024)
    if asked < 1:
        raise _fail(f"max_output_len: {asked} is not a positive integer")
    kw["max_tokens"] = served.fit_max_tokens(prompt_len, asked, "prompt", clip=True)
    try:
        return SamplingParams(**kw)
    except InferflowError as e:
        raise _fail(str(e)) from None


async def native(request: Request) -> Response:
    state = request.app.state.service
    try:
        body = await read_json(request, state.config.max_body_bytes)
        if not isinstance(body, dict):
            raise _fail("the request body must be a JSON object")
        header = body.get("header") if isinstance(body.get("header"), dict) else {}
        state.check_key(request, header.get("passcode") if isinstance(header.get("passcode"), str) else None)
        served = state.model(body["model"]) if isinstance(body.get("model"), str) else state.default_model()
        if header.get("fn") == "get_stat" or request.url.path.rstrip("/").endswith("get_stat"):
            return JSONResponse({"ret_code": "succ", "stat": served.engine.metrics()})
        state.check_ready()
        if not served.generates:
            raise _fail(f"model {served.name!r} is encoder-only; use /v1/embeddings")
        if not _str(body, "text") and not _str(body, "res_prefix"):
            raise _fail("the request has no text", "error.empty_request")
        try:
            ids, encoder = native_prompt(served, body)
        except InferflowError as e:
            raise _fail(str(e)) from None
        if not ids and encoder is None:
            raise _fail("the prompt encodes to no tokens", "error.empty_request")
        if len(ids) >= served.max_model_len:
            raise _fail(f"the prompt has {len(ids)} tokens; the model's context is {served.max_model_len} tokens",
                        "error.too_long_request")
        params = native_params(served, body, len(ids))
        if state.config.max_tokens_limit is not None:  # Inferflow clips lengths rather than refusing them
            params.max_tokens = min(params.max_tokens, state.config.max_tokens_limit)
        streaming = body.get("is_streaming_mode", True)
        gen = Generation(state, served, ids, params, encoder_prompt=encoder)
    except APIError as e:
        return _native_error(e)
    if streaming and streaming not in ("0", "false"):
        return CancellingStream(_stream(gen), media_type=NDJSON_MEDIA_TYPE, on_close=gen.close)
    try:
        final = await gen.result(request)
    except APIError as e:
        return _native_error(e)
    out = final.outputs[0]
    error = final.error or ""
    return JSONResponse({"text": out.text, "ret_code": "error.processing" if error else "succ", "error_text": error,
                         "time_cost": round(time.perf_counter() - gen.t0, 6), "is_end": 1,
                         "finish_reason": out.finish_reason})


async def _stream(gen: Generation) -> AsyncIterator[bytes]:
    guard = Utf8Guard()
    try:
        async for out in gen.deltas():
            o = out.outputs[0]
            text = guard.feed(o.delta_text, final=out.finished)
            elapsed = round(time.perf_counter() - gen.t0, 6)
            if out.finished:
                error = out.error or ""
                yield ndjson_line({"text": text, "ret_code": "error.processing" if error else "succ",
                                   "error_text": error, "time_cost": elapsed, "is_end": 1,
                                   "finish_reason": o.finish_reason})
            elif text:
                yield ndjson_line({"text": text, "ret_code": "succ", "error_text": "", "time_cost": elapsed,
                                   "is_end": 0})
    except APIError as e:
        if gen.final is None or not gen.final.finished:  # a finished request's last chunk carried its error already
            yield ndjson_line({"text": "", "ret_code": "error.processing", "error_text": e.message, "time_cost": 0.0,
                               "is_end": 1})
