"""Request fields -> guided decoding (engine/guided/): ``response_format``, vLLM's ``guided_json`` /
``guided_choice`` extras, and forced tool calls.

``tool_choice: "required"`` or a named function makes the output a tool call in the format the chat template
teaches (tool_calls.py), with the arguments constrained to the tool's ``parameters`` schema, as vLLM turns tools
into a guided-JSON schema (serving.md §2: "required" is an anyOf over the tools' {name, parameters}):
- ``<tool_call>`` templates: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (one call);
- ``[TOOL_CALLS]`` templates: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (one or more calls);
- JSON-tool templates, and templates that define no format (parsed with the JSON format then):
  ``{"name": ..., "parameters": {...}}``.
So the route's parser always finds the call, whatever the model. Precedence: a forced tool call, then
``response_format``, then the extras. Schemas outside the supported subset are a 400 naming the field.
"""
from __future__ import annotations

import json
from typing import Any

from ..engine.guided import SchemaError, compile_schema, is_guided, validate
from ..errors import InferflowError
from ..engine.guided.schema import inline_refs
from .errors import bad_request
from .tool_calls import HermesParser, JsonParser, MistralParser, ToolParser

UNSUPPORTED = ("guided_regex", "guided_grammar", "structural_tag", "guided_whitespace_pattern")


def check_schema(schema: Any, param: str) -> Any:
    """The schema (a dict) when guided decoding supports it; else a 400 naming ``param`` and the problem."""
    if not isinstance(schema, dict):
        raise bad_request("must be a JSON schema object", param)
    try:
        compile_schema(schema)
    except SchemaError as e:
        raise bad_request(f"unsupported schema: {e}", param) from None
    return schema


def guided_fields(body: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams fields from vLLM's extras ``guided_json`` (an object, a JSON string or true) and
    ``guided_choice``; the other guided kinds are refused by name."""
    for name in UNSUPPORTED:
        if body.get(name) is not None:
            raise bad_request("is not supported (use guided_json, guided_choice or response_format)", name)
    out: dict[str, Any] = {}
    gj = body.get("guided_json")
    if gj is not None:
        if isinstance(gj, str):
            try:
                gj = json.loads(gj)
            except (ValueError, RecursionError) as e:  # JSONDecodeError, over-long integers, absurd nesting
                raise bad_request(f"is not valid JSON: {type(e).__name__}: {e}", "guided_json") from None
        out["guided_json"] = gj if gj is True else check_schema(gj, "guided_json")
    choice = body.get("guided_choice")
    if choice is not None:
        if not isinstance(choice, list) or not choice or not all(isinstance(c, str) and c for c in choice):
            raise bad_request("must be a non-empty list of non-empty strings", "guided_choice")
        if gj is not None:
            raise bad_request("cannot be combined with guided_json", "guided_choice")
        out["guided_choice"] = list(choice)
    return out


def response_format_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    """The schema of ``response_format: {"type": "json_schema", "json_schema": {"name", "schema", ...}}``."""
    fmt = body.get("response_format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return None
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("json_schema must be an object with 'name' and 'schema'", "response_format")
    schema = spec.get("schema", {})
    return check_schema(schema if schema is not None else {}, "response_format.json_schema.schema")


def _call(tool: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object"}
    try:
        params = inline_refs(params)
    except SchemaError as e:
        raise bad_request(f"unsupported schema: {e}", where) from None
    check_schema(params, where)
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, key: params},
            "required": ["name", key], "additionalProperties": False}


def tool_guidance(tools: list[dict[str, Any]], choice: Any, parser: ToolParser | None
                  ) -> tuple[ToolParser, dict[str, Any]]:
    """(parser, SamplingParams fields) that force a tool call for ``tool_choice`` "required" / a named tool."""
    name = choice["function"]["name"] if isinstance(choice, dict) else None
    chosen = [(i, t) for i, t in enumerate(tools) if name is None or t["function"]["name"] == name]
    parser = parser if parser is not None else JsonParser()
    key = "parameters" if isinstance(parser, JsonParser) else "arguments"
    calls = [_call(t, key, f"tools[{i}].function.parameters") for i, t in chosen]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if isinstance(parser, HermesParser):
        return parser, {"guided_json": call, "guided_prefix": "<tool_call>\n", "guided_suffix": "\n</tool_call>"}
    if isinstance(parser, MistralParser):
        return parser, {"guided_json": {"type": "array", "minItems": 1, "items": call},
                        "guided_prefix": "[TOOL_CALLS]"}
    return parser, {"guided_json": call}


def apply_chat_guidance(params: Any, opts: Any, parser: ToolParser | None) -> ToolParser | None:
    """Set ``params``' guided fields from a chat request's options; returns the tool parser the route uses."""
    fields: dict[str, Any] = {}
    if opts.tools_active and opts.tool_choice != "auto":
        parser, fields = tool_guidance(opts.tools, opts.tool_choice, parser)
    elif opts.json_schema is not None:
        fields = {"guided_json": opts.json_schema}
    elif opts.json_mode:
        fields = {"guided_json": True}
    if fields:
        params.guided_json, params.guided_choice = None, None
        for k, v in fields.items():
            setattr(params, k, v)
    check_params(params)
    return parser


def check_params(params: Any) -> None:
    """400 for sampling settings guided decoding cannot be combined with (mirostat, ignore_eos, ...)."""
    if is_guided(params):
        try:
            validate(params)
        except InferflowError as e:
            raise bad_request(str(e), "guided_json" if params.guided_json is not None else "guided_choice") \
                from None
