"""What a model folder and its spec say about a tokenizer, independent of the backend that encodes text.

Special tokens, add_bos/add_eos, extra stop tokens and chat templates come from tokenizer_config.json,
special_tokens_map.json, generation_config.json and chat_template.{jinja,json}; the spec's ``tokenizer:`` and
``chat_template:`` sections override them. ``apply`` copies the result onto any Tokenizer, so backends that get their
vocabulary elsewhere (GGUF metadata, ...) can share the same override rules.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import FormatError, SpecError
from ..spec.expr import resolve
from .base import Tokenizer

# HF's named special tokens, in the order HF passes them to chat templates.
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_MAX_JSON_BYTES = 256 << 20  # tokenizer.json of the largest vocabularies is ~30 MB; refuse absurd files


def read_json(path: Path) -> Any:
    try:
        if path.stat().st_size > _MAX_JSON_BYTES:
            raise FormatError(str(path), f"larger than {_MAX_JSON_BYTES >> 20} MiB")
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(str(path), f"cannot read JSON: {e}") from None


def token_text(value: Any) -> str | None:
    """A special token as saved by HF: a plain string or a serialized AddedToken ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _templates(value: Any, where: str) -> dict[str, str]:
    """HF stores one template as a string, several as a list of {"name", "template"}."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise FormatError(where, "chat_template must be a string or a list of {name, template} objects")


@dataclass(slots=True)
class TokenizerSettings:
    """Everything around the vocabulary: which file, special tokens, BOS/EOS insertion, stop ids, templates."""

    folder: Path | None = None
    config: dict[str, Any] = field(default_factory=dict)  # tokenizer_config.json as read
    special: dict[str, str | None] = field(default_factory=dict)  # name ("bos_token", ...) -> text
    extra_special: list[str] = field(default_factory=list)  # additional/extra special tokens
    added_tokens: dict[int, dict[str, Any]] = field(default_factory=dict)  # tokenizer_config added_tokens_decoder
    add_bos: bool | None = None  # from the spec; None: whatever the tokenizer file does
    add_eos: bool | None = None
    config_add_bos: bool | None = None  # tokenizer_config.json add_bos_token (transformers ignores it
    config_add_eos: bool | None = None  # when tokenizer.json exists, honours it for SentencePiece models)
    chat_templates: dict[str, str] | None = None  # None: nothing found or said; {}: explicitly none
    eos_ids: list[int] = field(default_factory=list)  # generation_config.json eos_token_id
    extra_eos_tokens: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)  # spec override of the tokenizer file names
    clean_up_spaces: bool = False
    legacy: bool = False

    def file(self, defaults: tuple[str, ...]) -> Path | None:
        """The first tokenizer file that exists, from the spec's ``files`` or ``defaults``; never outside the folder."""
        if self.folder is None:
            return None
        root = self.folder.resolve()
        for name in self.files or defaults:
            p = (self.folder / name).resolve()
            if root not in p.parents:
                raise SpecError(None, "tokenizer.files", f"{name!r} is outside the model folder")
            if p.is_file():
                return p
        return None

    def apply(self, tok: Tokenizer) -> Tokenizer:
        """Copy onto ``tok`` whatever these settings say (ids looked up with token_to_id); keep the rest of ``tok``."""
        special = {**(tok.special_tokens or {}), **self.special}
        tok.special_tokens = {k: v for k, v in special.items() if v is not None}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if name in self.special:  # present with None: the model has no such token
                text = self.special[name]
                setattr(tok, name, text)
                setattr(tok, f"{name}_id", tok.token_to_id(text) if text is not None else None)
        extra = [*tok.extra_eos_ids, *self.eos_ids]
        for text in self.extra_eos_tokens:
            i = tok.token_to_id(text)
            if i is None:
                raise SpecError(None, "tokenizer.extra_eos_tokens", f"{text!r} is not in the vocabulary")
            extra.append(i)
        tok.extra_eos_ids = tuple(dict.fromkeys(i for i in extra if i != tok.eos_token_id))
        for key in ("add_bos", "add_eos"):
            if getattr(self, key) is not None:
                setattr(tok, key, getattr(self, key))
        if self.chat_templates is not None:
            tok.chat_templates = dict(self.chat_templates)
            tok.chat_template = self.chat_templates.get("default")
        return tok


def read_settings(folder: Path | None, spec: Any = None, params: dict[str, Any] | None = None) -> TokenizerSettings:
    """Settings from the files in ``folder`` (may be None) overridden by ``spec``'s tokenizer sections."""
    s = TokenizerSettings(folder=folder)
    if folder is not None:
        _read_folder(s, folder)
    if spec is not None:
        _apply_spec(s, spec, params or {})
    return s


def _read_folder(s: TokenizerSettings, folder: Path) -> None:
    p = folder / "tokenizer_config.json"
    cfg = read_json(p) if p.is_file() else {}
    if not isinstance(cfg, dict):
        raise FormatError(str(p), "expected a JSON object")
    s.config = cfg
    for name in SPECIAL_NAMES:
        if name in cfg:
            s.special[name] = token_text(cfg[name])
    for name, value in cfg.items():  # model-specific ones (image_token, ...) are special tokens too
        if name.endswith("_token") and name not in s.special and token_text(value) is not None:
            s.special[name] = token_text(value)
    for key in ("additional_special_tokens", "extra_special_tokens"):
        if isinstance(cfg.get(key), list):
            s.extra_special += [t for t in map(token_text, cfg[key]) if t is not None]
    # Like HF: special_tokens_map.json is legacy; it fills gaps, and wins only for configs that predate
    # added_tokens_decoder (which HF then ignores the map for).
    p = folder / "special_tokens_map.json"
    if p.is_file():
        smap = read_json(p)
        if isinstance(smap, dict):
            legacy = "added_tokens_decoder" not in cfg
            for name in SPECIAL_NAMES:
                if name in smap and (legacy or name not in s.special):
                    s.special[name] = token_text(smap[name])
            for key in ("additional_special_tokens", "extra_special_tokens"):
                if isinstance(smap.get(key), list):
                    s.extra_special += [t for t in map(token_text, smap[key]) if t and t not in s.extra_special]
    added = cfg.get("added_tokens_decoder")
    if isinstance(added, dict):
        for idx, tok in added.items():
            if isinstance(tok, dict) and isinstance(tok.get("content"), str) and str(idx).isdigit():
                s.added_tokens[int(idx)] = tok
    for key in ("add_bos_token", "add_eos_token"):
        if isinstance(cfg.get(key), bool):
            setattr(s, "config_" + key[:7], cfg[key])
    s.clean_up_spaces = bool(cfg.get("clean_up_tokenization_spaces", False))
    s.legacy = bool(cfg.get("legacy", False))
    s.chat_templates = _read_templates(folder, cfg)
    p = folder / "generation_config.json"
    if p.is_file():
        gen = read_json(p)
        eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
        eos = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
        s.eos_ids = [i for i in eos if isinstance(i, int) and not isinstance(i, bool)]


def _read_templates(folder: Path, cfg: dict[str, Any]) -> dict[str, str] | None:
    # As transformers: template files (chat_template.jinja, additional_chat_templates/NAME.jinja) replace those in
    # tokenizer_config.json; a processor's chat_template.json is the fallback when neither has one.
    files: dict[str, str] = {}
    p = folder / "chat_template.jinja"
    if p.is_file():
        files["default"] = _read_text(p)
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for t in sorted(extra.glob("*.jinja")):
            files[t.stem] = _read_text(t)
    if files:
        return files
    found = _templates(cfg.get("chat_template"), str(folder / "tokenizer_config.json"))
    p = folder / "chat_template.json"
    if not found and p.is_file():
        data = read_json(p)
        found = _templates(data.get("chat_template") if isinstance(data, dict) else data, str(p))
    return found or None


def _read_text(p: Path) -> str:
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(str(p), f"cannot read: {e}") from None


def _strings(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _apply_spec(s: TokenizerSettings, spec: Any, params: dict[str, Any]) -> None:
    data = getattr(spec, "data", spec) or {}
    file = getattr(spec, "file", None)
    tok = data.get("tokenizer") or {}
    if "files" in tok:
        s.files = _strings(tok["files"])
    for key in ("add_bos", "add_eos"):
        if key in tok:
            value = resolve(tok[key], params, where=(file, f"tokenizer.{key}"))
            if not isinstance(value, bool):
                raise SpecError(file, f"tokenizer.{key}", f"expected a boolean, got {value!r}")
            setattr(s, key, value)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if name in tok:  # an explicit null means "this model has no such token"
            s.special[name] = tok[name]
    s.extra_eos_tokens = _strings(tok.get("extra_eos_tokens"))
    if "chat_template" in data:  # a string replaces the model's templates; null removes them
        s.chat_templates = {"default": data["chat_template"]} if data["chat_template"] is not None else {}
