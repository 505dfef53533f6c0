"""Tokenizers: HF tokenizer.json, SentencePiece .model, and the chat templates that go with them."""
from __future__ import annotations

from typing import Any


def load_tokenizer(src: Any, spec: Any, params: dict[str, Any]):
    """The tokenizer that ships with ``src`` (None when the model comes without one)."""
    from .hf import from_source

    return from_source(src, spec)
