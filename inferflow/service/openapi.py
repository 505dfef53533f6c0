"""The OpenAPI 3.1 document served at ``/openapi.json``: every route, its request fields and error responses."""
from __future__ import annotations

from typing import Any

from .protocol import SAMPLING_FIELDS

_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}}}
_NUM = {"type": "number"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_STR = {"type": "string"}
_STOP = {"oneOf": [_STR, {"type": "array", "items": _STR}]}


def _sampling() -> dict[str, Any]:
    props: dict[str, Any] = {}
    for name, (_, types, want) in SAMPLING_FIELDS.items():
        kind = {bool: _BOOL, int: _INT, float: _NUM, list: {"type": "array", "items": _INT}}[types[-1]]
        props[name] = {**kind, "description": want}
    props.update(model=_STR, stream=_BOOL, stream_options={"type": "object", "properties": {
        "include_usage": _BOOL, "continuous_usage_stats": _BOOL}}, seed=_INT, stop=_STOP,
        logit_bias={"type": "object", "additionalProperties": _NUM}, cache_salt=_STR,
        guided_json={"oneOf": [{"type": "object"}, _STR, _BOOL]}, guided_choice={"type": "array", "items": _STR})
    return props


def _chat() -> dict[str, Any]:
    message = {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [_STR, {"type": "array"}, {"type": "null"}]}, "tool_calls": {"type": "array"},
        "tool_call_id": _STR, "name": _STR}}
    return {"type": "object", "required": ["messages"], "properties": {
        **_sampling(), "messages": {"type": "array", "items": message}, "max_tokens": _INT,
        "max_completion_tokens": _INT, "logprobs": _BOOL, "top_logprobs": _INT, "tools": {"type": "array"},
        "tool_choice": {"oneOf": [{"enum": ["none", "auto", "required"]}, {"type": "object"}]},
        "response_format": {"type": "object", "properties": {"type": {"enum": ["text", "json_object", "json_schema"]},
                                                             "json_schema": {"type": "object"}}},
        "chat_template": _STR, "chat_template_kwargs": {"type": "object"}, "add_generation_prompt": _BOOL,
        "continue_final_message": _BOOL}}


def _completion() -> dict[str, Any]:
    return {"type": "object", "required": ["prompt"], "properties": {
        **_sampling(), "prompt": {"oneOf": [_STR, {"type": "array"}]}, "max_tokens": _INT,
        "logprobs": {"type": ["integer", "null"]}, "echo": _BOOL}}


def _native() -> dict[str, Any]:
    return {"type": "object", "properties": {
        "text": _STR, "system_prompt": _STR, "res_prefix": _STR, "decoding_alg": {"oneOf": [_STR, {"type": "object"}]},
        "temperature": _NUM, "random_seed": _INT, "max_output_len": _INT, "max_new_tokens": _INT,
        "is_streaming_mode": {"oneOf": [_BOOL, _INT]}, "encoder_input_template": _STR,
        "decoder_input_template": _STR, "model": _STR,
        "header": {"type": "object", "properties": {"fn": _STR, "passcode": _STR}}}}


_ROUTES: list[tuple[str, str, str, Any, str]] = [
    ("/v1/chat/completions", "post", "Chat completion (OpenAI); SSE when stream is true", _chat, "text/event-stream"),
    ("/v1/completions", "post", "Text completion (OpenAI); SSE when stream is true", _completion, "text/event-stream"),
    ("/v1/embeddings", "post", "Embeddings of encoder-only models (OpenAI)",
     lambda: {"type": "object", "required": ["input"], "properties": {
         "model": _STR, "input": {"oneOf": [_STR, {"type": "array"}]},
         "encoding_format": {"enum": ["float", "base64"]}, "dimensions": _INT}}, None),
    ("/v1/models", "get", "Served models (OpenAI)", None, None),
    ("/v1/models/{model}", "get", "One served model", None, None),
    ("/", "post", "Inferflow's native route; newline-delimited JSON when streaming", _native, "application/x-ndjson"),
    ("/tokenize", "post", "Token ids of a prompt or of chat messages",
     lambda: {"type": "object", "properties": {"model": _STR, "prompt": _STR, "messages": {"type": "array"},
                                               "add_special_tokens": _BOOL}}, None),
    ("/detokenize", "post", "Text of token ids",
     lambda: {"type": "object", "required": ["tokens"], "properties": {
         "model": _STR, "tokens": {"type": "array", "items": _INT}}}, None),
    ("/health", "get", "200 when the engines run; 503 while starting or stopping, or when an engine died", None, None),
    ("/metrics", "get", "Prometheus metrics", None, None),
]


def openapi_document(version: str, auth: bool) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for path, method, summary, schema, stream_type in _ROUTES:
        op: dict[str, Any] = {"summary": summary, "responses": {
            "200": {"description": "OK", "content": {"application/json": {}}},
            "400": {"description": "Invalid field (named in error.param)",
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}}
        if stream_type:
            op["responses"]["200"]["content"][stream_type] = {}
        if schema is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema()}}}
            op["responses"].update({
                "404": {"description": "Unknown model"}, "413": {"description": "Body larger than max_body_bytes"},
                "429": {"description": "Too many concurrent requests (Retry-After)"},
                "503": {"description": "Overloaded or not ready (Retry-After)"}})
        if auth and path != "/health":
            op["security"] = [{"bearer": []}]
            op["responses"]["401"] = {"description": "Missing or wrong API key"}
        paths.setdefault(path, {})[method] = op
    doc: dict[str, Any] = {"openapi": "3.1.0", "info": {"title": "inferflow", "version": version},
                           "paths": paths, "components": {"schemas": {"Error": _ERROR}}}
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
