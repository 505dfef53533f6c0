"""The tokenizer interface every backend (tokenizers, sentencepiece, GGUF metadata) implements."""
from __future__ import annotations

from typing import Any, Sequence


class Tokenizer:
    """Text <-> ids, special tokens and the model's chat template."""

    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    add_bos: bool = False
    add_eos: bool = False
    chat_template: str | None = None  # the default template
    chat_templates: dict[str, str] | None = None  # all named templates ("default", "tool_use", ...)
    special_tokens: dict[str, str] | None = None  # "bos_token" -> text, ...: what chat templates see
    extra_eos_ids: tuple[int, ...] = ()

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    def id_to_token(self, idx: int) -> str | None:
        raise NotImplementedError

    @property
    def stop_ids(self) -> set[int]:
        ids = set(self.extra_eos_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return ids

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render ``messages`` with the model's Jinja chat template."""
        from .chat import render_chat

        return render_chat(self, messages, add_generation_prompt=add_generation_prompt, **kwargs)
