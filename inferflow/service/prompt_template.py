"""Inferflow prompt templates (``decoder_input_template`` / ``encoder_input_template``) rendered to token ids.

Placeholders in braces (shared/reference/inferflow.md §2.5): ``{query}``/``{question}`` (``{_query}`` with a leading
space), ``{system_prompt}``, ``{res_prefix}``/``{answer}`` (the template is cut there and the response prefix is
appended last), ``{bos}``, ``{eos}``, ``{user_token}``/``{assistant_token}`` (ids from the model's generation
config), ``{#N}`` a raw token id, ``{\\n}``/``{\\r}``/``{\\t}``, and ``{<any>}`` a single vocabulary token
(``{<s>}``, ``{[CLS]}``, ``{__en__}``, ``{ }``). Text outside braces is tokenized normally.
"""
from __future__ import annotations

import re
from typing import Any

from ..errors import InferflowError

_PART = re.compile(r"\{([^{}]*)\}")
_ESCAPES = {"\\n": "\n", "\\r": "\r", "\\t": "\t"}


def unescape(text: str) -> str:
    """Inferflow's query-list escapes: ``{\\n}``, ``{\\r}``, ``{\\t}``."""
    for k, v in _ESCAPES.items():
        text = text.replace("{" + k + "}", v)
    return text


def _token_id(tok: Any, name: str, template: str) -> int:
    for cand in (name, name.replace(" ", "\u2581"), name.replace(" ", "\u0120")):
        idx = tok.token_to_id(cand)
        if idx is not None:
            return idx
    raise InferflowError(f"prompt template {template!r}: {{{name}}} is not a token of this model's vocabulary")


def render_template(template: str, tok: Any, *, query: str = "", system_prompt: str = "", res_prefix: str = "",
                    config: dict[str, Any] | None = None) -> list[int]:
    """Token ids of ``template`` with the placeholders filled (text runs are encoded without special tokens)."""
    segments: list[str | int] = []
    pos, cut = 0, False
    for m in _PART.finditer(template):
        if m.start() > pos:
            segments.append(template[pos:m.start()])
        pos = m.end()
        name = m.group(1)
        if name in ("query", "question"):
            segments.append(query)
        elif name in ("_query", "_question"):
            segments.append(" " + query)
        elif name == "system_prompt":
            segments.append(system_prompt)
        elif name in ("res_prefix", "answer"):
            cut = True
            break
        elif name in _ESCAPES:
            segments.append(_ESCAPES[name])
        elif name in ("bos", "eos"):
            idx = getattr(tok, f"{name}_token_id", None)
            if idx is None:
                raise InferflowError(f"prompt template {template!r}: this model has no {name} token")
            segments.append(idx)
        elif name in ("user_token", "assistant_token"):
            idx = (config or {}).get(f"{name}_id")
            if not isinstance(idx, int):
                raise InferflowError(f"prompt template {template!r}: the model's config has no {name}_id")
            segments.append(idx)
        elif name.startswith("#") and name[1:].isdigit():
            segments.append(int(name[1:]))
        else:
            segments.append(_token_id(tok, name, template))
    if not cut and pos < len(template):
        segments.append(template[pos:])
    ids: list[int] = []
    run = ""
    for seg in segments + [-1]:
        if isinstance(seg, str):
            run += seg
            continue
        if run:
            ids += tok.encode(run, add_special_tokens=False)
            run = ""
        if seg >= 0:
            ids.append(seg)
    if res_prefix:
        ids += tok.encode(res_prefix, add_special_tokens=False)
    return ids
