"""Tool calls parsed out of generated text, in the format the model's chat template teaches it.

The format is chosen from what the template contains (never from a model name):
- ``<tool_call>`` (Hermes, Qwen 2/2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, repeated;
- ``[TOOL_CALLS]`` (Mistral): ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` or
  ``[TOOL_CALLS]name[ARGS]{...}``;
- ``<|python_tag|>`` or ``ipython`` (Llama 3.1+ JSON tools): the whole answer is ``{"name": ..., "parameters": {...}}``
  (``;``-separated for several), optionally after ``<|python_tag|>``.
Text before the first call is the message content. When nothing parses, the text stays content: a model that
writes malformed JSON yields an ordinary answer rather than an error.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str          # a JSON string, as OpenAI sends it
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = "call_" + uuid.uuid4().hex[:24]

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], args)


def _json_values(text: str) -> list[Any]:
    """Consecutive JSON values in ``text`` (separated by whitespace, ``;`` or ``,``); stops at the first non-JSON."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return out
        out.append(value)


class ToolParser:
    """Base: ``markers`` start a tool-call section; ``parse`` splits text into content and calls."""

    markers: tuple[str, ...] = ()
    leading_json = False    # a '{' as the first non-space character also starts a tool call

    def start(self, text: str) -> int | None:
        """Index where a tool-call section starts in ``text`` (None: not yet)."""
        hits = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if self.leading_json and text.lstrip().startswith("{"):
            hits.append(len(text) - len(text.lstrip()))
        return min(hits) if hits else None

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class HermesParser(ToolParser):
    markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = []
        for body in self._BLOCK.findall(text[start:]):
            values = _json_values(body)
            call = _call(values[0]) if values else None
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].rstrip(), calls


class MistralParser(ToolParser):
    markers = ("[TOOL_CALLS]",)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = text.find("[TOOL_CALLS]")
        if start < 0:
            return text, []
        rest = text[start + len("[TOOL_CALLS]"):]
        calls: list[ToolCall] = []
        if "[ARGS]" in rest:  # v11+ format: name[ARGS]{json}, repeated with [TOOL_CALLS]
            for part in rest.split("[TOOL_CALLS]"):
                name, _, args = part.partition("[ARGS]")
                values = _json_values(args)
                if not name.strip() or not values:
                    return text, []
                calls.append(ToolCall(name.strip(), json.dumps(values[0], ensure_ascii=False)))
        else:
            values = _json_values(rest)
            items = values[0] if values and isinstance(values[0], list) else values
            calls = [c for c in (_call(v) for v in items) if c is not None]
            if not calls or len(calls) != len(items):
                return text, []
        return text[:start].rstrip(), calls


class JsonParser(ToolParser):
    markers = ("<|python_tag|>",)
    leading_json = True

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        start = self.start(text)
        if start is None:
            return text, []
        body = text[start:].replace("<|python_tag|>", "", 1)
        values = _json_values(body)
        calls = [c for c in (_call(v) for v in values) if c is not None]
        if not calls or len(calls) != len(values) or body.strip()[-1:] not in ("}", ";"):
            return text, []
        return text[:start].rstrip(), calls


def parser_for(chat_template: str | None) -> ToolParser | None:
    """The tool-call format a chat template teaches, or None when it defines no tools."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return HermesParser()
    if "[TOOL_CALLS]" in t:
        return MistralParser()
    if "<|python_tag|>" in t or "ipython" in t:
        return JsonParser()
    return None


class ToolStream:
    """Streams content until a tool-call section starts; holds back text that may be the start of a marker."""

    def __init__(self, parser: ToolParser):
        self.parser, self.text, self.sent, self.in_tools = parser, "", 0, False

    def _holdback(self) -> int:
        """Characters at the end that could begin a marker (or leading whitespace before a possible '{')."""
        if self.parser.leading_json and not self.text.strip():
            return len(self.text)
        keep = 0
        for m in self.parser.markers:
            for k in range(min(len(m) - 1, len(self.text)), 0, -1):
                if self.text.endswith(m[:k]):
                    keep = max(keep, k)
                    break
        return keep

    def feed(self, delta: str) -> str:
        """Content to send now."""
        self.text += delta
        if self.in_tools:
            return ""
        start = self.parser.start(self.text)
        if start is not None:
            self.in_tools = True
            out, self.sent = self.text[self.sent:start], max(self.sent, start)
            return out
        end = len(self.text) - self._holdback()
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, tool calls) once generation ended."""
        content, calls = self.parser.parse(self.text)
        if calls:
            return "", calls
        out, self.sent = self.text[self.sent:], len(self.text)
        return out, []
