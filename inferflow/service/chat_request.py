"""The chat-specific parts of a ``/v1/chat/completions`` request: messages, tools, tool_choice, response_format.

Messages are normalised into what chat templates expect (vLLM does the same): text parts joined into one string,
``developer`` treated as ``system``, and tool-call arguments given as JSON strings turned into objects, since most
templates render them with ``tojson``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .errors import bad_request
from .guided import response_format_schema
from .protocol import check_type

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def _content(value: Any, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"content part of type {kind!r} is not supported (text only)", f"{where}[{j}]")
            if not isinstance(part.get("text"), str):
                raise bad_request("a text part needs a string 'text'", f"{where}[{j}].text")
            parts.append(part["text"])
        return "\n".join(parts)
    raise bad_request("must be a string, a list of content parts or null", where)


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise bad_request("must be a list", where)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request("each tool call needs function.name", f"{where}[{j}]")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):  # not JSON (or absurdly nested)
                pass  # keep the string: the template shows what the client sent
        out.append({**c, "type": c.get("type", "function"), "function": {**fn, "arguments": args}})
    return out


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request("each message must be an object with 'role' and 'content'", where)
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # a list or object role is unhashable
            raise bad_request(f"role {role!r} is not one of {', '.join(sorted(_ROLES))}", f"{where}.role")
        msg = {k: v for k, v in m.items() if v is not None}
        msg["role"] = "system" if role == "developer" else role
        content = _content(m.get("content"), f"{where}.content")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            if role != "assistant":
                raise bad_request("content is required", f"{where}.content")
            content = ""
        msg["content"] = content if content is not None else ""
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        out.append(msg)
    return out


@dataclass(slots=True)
class ChatOptions:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = "none"               # "none" | "auto" | "required" | {"type": "function", "function": {name}}
    json_mode: bool = False                 # response_format json_object
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    logprobs: bool = False
    echo: bool = False
    json_schema: dict[str, Any] | None = None  # response_format json_schema's schema (checked by guided.py)

    @property
    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = check_type(body, "tools", (list,), "a list of tools")
    if tools is None:
        return None
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request("each tool must be {'type': 'function', 'function': {'name': ..., ...}}", f"tools[{j}]")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request("must be a JSON schema object", f"tools[{j}].function.parameters")
    return tools


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> Any:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice != "none" and tools is None:
        raise bad_request("tool_choice needs 'tools'", "tool_choice")
    if choice in ("none", "auto"):
        return choice
    if choice == "required":
        return "required" if tools else "none"  # vLLM: required with an empty tool list means none
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        names = [t["function"]["name"] for t in tools or []]
        if name not in names:
            raise bad_request(f"tool {name!r} is not among the tools ({', '.join(names)})", "tool_choice")
        return {"type": "function", "function": {"name": name}}
    raise bad_request("must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
                      "tool_choice")


def _json_mode(body: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
    fmt = check_type(body, "response_format", (dict,), "an object like {'type': 'json_object'}")
    if fmt is None or fmt.get("type") in ("text", "json_schema"):  # json_schema: guided.response_format_schema
        return False
    if fmt.get("type") != "json_object":
        raise bad_request(f"type {fmt.get('type')!r} is not supported (use 'text', 'json_object' or 'json_schema')",
                          "response_format")
    # OpenAI's own rule: json_object mode only when the conversation asks for JSON, or the model may never stop
    if not any("json" in (m.get("content") or "").lower() for m in messages):
        raise bad_request("'messages' must contain the word 'json' in some form to use 'response_format' of type "
                          "'json_object'", "response_format")
    return True


def chat_options(body: dict[str, Any]) -> ChatOptions:
    messages = normalize_messages(body.get("messages"))
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    logprobs = bool(check_type(body, "logprobs", (bool,), "a boolean"))
    top = check_type(body, "top_logprobs", (int,), "an integer")
    if top is not None and top < 0:
        raise bad_request(f"{top} is negative", "top_logprobs")
    if top and not logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    agp = check_type(body, "add_generation_prompt", (bool,), "a boolean")
    cont = bool(check_type(body, "continue_final_message", (bool,), "a boolean"))
    if cont and agp:
        raise bad_request("cannot be combined with add_generation_prompt: true", "continue_final_message")
    if cont and messages[-1]["role"] != "assistant":
        raise bad_request("the last message must be the assistant's to continue it", "continue_final_message")
    kwargs = check_type(body, "chat_template_kwargs", (dict,), "an object") or {}
    template = check_type(body, "chat_template", (str,), "a string")
    return ChatOptions(messages, tools, choice, _json_mode(body, messages), agp if agp is not None else not cont,
                       cont, template, dict(kwargs), logprobs, bool(check_type(body, "echo", (bool,), "a boolean")),
                       json_schema=response_format_schema(body))


def top_logprobs_count(body: dict[str, Any], opts: ChatOptions) -> int | None:
    """SamplingParams.logprobs for a chat request: None unless logprobs is true."""
    return (body.get("top_logprobs") or 0) if opts.logprobs else None
