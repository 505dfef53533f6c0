"""Tokenizers: HF tokenizer.json, SentencePiece .model, and the chat templates that go with them."""
from __future__ import annotations

from typing import Any

from .base import Tokenizer
from .chat import render_chat
from .settings import TokenizerSettings, read_settings


def load_tokenizer(src: Any, spec: Any, params: dict[str, Any]) -> Tokenizer | None:
    """The tokenizer that ships with ``src`` (None when the model comes without one)."""
    if getattr(src, "kind", None) == "llama2c":  # tokenizer.bin beside the checkpoint
        from .llama2c import from_source as llama2c_tokenizer

        return llama2c_tokenizer(src)
    if getattr(src, "kind", None) == "gguf":  # vocabulary and merges/scores in the file's metadata
        from .gguf import from_gguf

        return from_gguf(src, spec, params)
    from .hf import from_source

    return from_source(src, spec, params)


__all__ = ["Tokenizer", "TokenizerSettings", "load_tokenizer", "read_settings", "render_chat"]
