"""Rendering chat templates the way transformers does, inside Jinja's immutable sandbox.

Templates come with downloaded models and are untrusted code: they run in ImmutableSandboxedEnvironment, see only
plain JSON-like data, and get exactly the helpers transformers provides (raise_exception, strftime_now, its tojson,
dict, a namespace that refuses underscore names, loop controls and the {% generation %} tag).
"""
from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping

from ..errors import InferflowError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' override: no HTML escaping (Jinja's default would turn "<" into \u003c) and json.dumps options
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(source: str) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for training masks; rendering keeps the body
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        # namespace(...) that cannot store dunder/underscore attributes (a path toward Python internals)
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def make_dict(*args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=_strftime_now, dict=make_dict,
                       namespace=Namespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise InferflowError(f"chat template: syntax error on line {e.lineno}: {e.message}") from None


def plain(value: Any) -> Any:
    """Rebuild ``value`` from JSON-like types only, so templates never reach methods of arbitrary objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):  # subclasses (enums, numpy scalars) back to the base type
        if isinstance(value, base):
            return base(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _messages(messages: Any) -> list[dict[str, Any]]:
    out = []
    for m in plain(list(messages)):
        if not isinstance(m, dict):
            raise InferflowError(f"chat messages must be dicts with 'role' and 'content', got {m!r}")
        # Like transformers: keys with None values are dropped (templates test for presence), and reasoning given
        # under an older name is also visible as reasoning_content / thinking.
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def pick_template(tok: Any, chat_template: str | None = None, tools: Any = None) -> str:
    """The template to render: a name or template text passed in, else tool_use (with tools), else the default."""
    named = getattr(tok, "chat_templates", None) or {}
    if chat_template is not None:
        return named.get(chat_template, chat_template)
    if tools is not None and "tool_use" in named:
        return named["tool_use"]
    template = getattr(tok, "chat_template", None) or named.get("default")
    if template is None:
        if named:
            raise InferflowError(f"this model has several chat templates and none is the default; pass "
                                 f"chat_template= one of {sorted(named)}")
        raise InferflowError("this model has no chat template (no chat_template in tokenizer_config.json, "
                             "chat_template.jinja or the spec); pass chat_template= or set chat_template in the spec")
    return template


def render_chat(tok: Any, messages: Any, add_generation_prompt: bool = True, *, chat_template: str | None = None,
                tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
                **kwargs: Any) -> str:
    """Render ``messages`` ([{"role", "content"}, ...]) with the tokenizer's chat template.

    ``kwargs`` reach the template as variables (enable_thinking=..., date_string=...), overriding the special
    tokens (bos_token, eos_token, ...) that it also sees, as in transformers.
    """
    import jinja2

    template = compile_template(pick_template(tok, chat_template, tools))
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise InferflowError("tools must be JSON-schema dicts ({'type': 'function', 'function': {...}})")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise InferflowError("documents must be dicts with 'title' and 'text'")
    chat = _messages(messages)
    if not chat:
        raise InferflowError("cannot apply a chat template to an empty conversation")
    special = dict(getattr(tok, "special_tokens", None) or {})
    for name in ("bos_token", "eos_token"):
        if name not in special and getattr(tok, name, None) is not None:
            special[name] = getattr(tok, name)
    variables = {**special, **plain(kwargs)}
    try:
        return template.render(messages=chat, tools=plain(tools), documents=plain(documents),
                               add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:  # raise_exception(), sandbox violations, undefined calls
        raise InferflowError(f"chat template: {e}") from None
