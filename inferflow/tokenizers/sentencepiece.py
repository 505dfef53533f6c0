"""SentencePiece `.model` tokenizers, for folders that ship no tokenizer.json."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from ..errors import FormatError, InferflowError
from .base import Tokenizer
from .settings import TokenizerSettings


def _first(*values: bool | None) -> bool:
    return next(v for v in values if v is not None)


class SentencePieceTokenizer(Tokenizer):
    """SentencePiece encoding with transformers' treatment of special tokens around it.

    Special tokens written in the text (``<s>``, added tokens) are matched first and the pieces between them are
    encoded by SentencePiece; like transformers' non-legacy mode, only text at the very start gets the dummy-prefix
    space (``legacy: true`` in tokenizer_config.json gives every piece one).
    """

    def __init__(self, sp: Any, settings: TokenizerSettings, path: str = ""):
        self.sp, self.path = sp, path
        self.legacy = settings.legacy
        self._size = sp.get_piece_size()
        # The model's own control tokens are the defaults; tokenizer_config.json / the spec override them.
        for name, idx in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()), ("unk_token", sp.unk_id()),
                          ("pad_token", sp.pad_id())):
            if name not in settings.special and 0 <= idx < self._size:
                settings.special[name] = sp.id_to_piece(idx)
        # Tokens beyond the .model's pieces (tokenizer_config added_tokens_decoder); ids as saved there.
        self._added: dict[str, int] = {}
        self._added_text: dict[int, str] = {}
        special_ids = {i for i in range(self._size) if sp.is_control(i)}
        for idx, tok in settings.added_tokens.items():
            known = self._piece_id(tok["content"])
            idx = known if known is not None else idx
            self._added[tok["content"]] = idx
            self._added_text[idx] = tok["content"]
            if tok.get("special", True):
                special_ids.add(idx)
        settings.apply(self)
        for text in [v for v in settings.special.values() if v] + settings.extra_special:
            idx = self.token_to_id(text)
            if idx is not None:
                self._added.setdefault(text, idx)
                special_ids.add(idx)
        self._special_ids = special_ids
        # Match written special tokens longest first so "<s>" never wins over "<s>x" when both exist.
        texts = sorted((t for t in self._added if t), key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None
        # Default like transformers' sentencepiece tokenizers: BOS when the model defines one, no EOS.
        self.add_bos = _first(settings.add_bos, settings.config_add_bos, self.bos_token_id is not None)
        self.add_eos = _first(settings.add_eos, settings.config_add_eos, False)
        if self.add_bos and self.bos_token_id is None or self.add_eos and self.eos_token_id is None:
            raise InferflowError(f"{path}: add_bos/add_eos set but the tokenizer has no such token")
        self._sp_mid = _without_dummy_prefix(sp)

    def _piece_id(self, piece: str) -> int | None:
        idx = self.sp.piece_to_id(piece)
        # piece_to_id answers unk for unknown pieces; only a real match counts
        return idx if 0 <= idx < self._size and self.sp.id_to_piece(idx) == piece else None

    @property
    def vocab_size(self) -> int:
        return max([self._size - 1, *self._added_text]) + 1

    def _encode_text(self, text: str, first: bool) -> list[int]:
        return (self.sp if first or self.legacy else self._sp_mid).encode(text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        parts = self._split.split(text) if self._split else [text]
        pos = 0
        for k, part in enumerate(parts):
            if k % 2:  # a matched special token
                ids.append(self._added[part])
            elif part:
                ids += self._encode_text(part, first=pos == 0)
            pos += len(part)
        if add_special_tokens:
            ids = ([self.bos_token_id] if self.add_bos else []) + ids + ([self.eos_token_id] if self.add_eos else [])
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out: list[str] = []
        run: list[int] = []

        def flush() -> None:
            if run:
                text = self.sp.decode(run)
                # SentencePiece drops the leading space of what it decodes; keep it when text precedes the run
                if out and self.sp.id_to_piece(run[0]).startswith("\u2581"):
                    text = " " + text
                out.append(text)
                run.clear()

        for i in map(int, ids):
            if i in self._special_ids or i in self._added_text or not 0 <= i < self._size:
                flush()
                if not (skip_special_tokens and i in self._special_ids):
                    out.append(self.id_to_token(i) or "")
            else:
                run.append(i)
        flush()
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        return self._added.get(token, self._piece_id(token))

    def id_to_token(self, idx: int) -> str | None:
        idx = int(idx)
        if idx in self._added_text:
            return self._added_text[idx]
        return self.sp.id_to_piece(idx) if 0 <= idx < self._size else None

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        b = buf[pos]
        value |= (b & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if b < 0x80:
            return value, pos


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _fields(buf: bytes) -> list[tuple[int, int, bytes]]:
    """Top-level protobuf fields as (number, wire type, raw bytes of the whole field)."""
    out, pos = [], 0
    while pos < len(buf):
        start = pos
        tag, pos = _varint(buf, pos)
        kind = tag & 7
        if kind == 0:
            _, pos = _varint(buf, pos)
        elif kind == 1:
            pos += 8
        elif kind == 2:
            n, pos = _varint(buf, pos)
            pos += n
        elif kind == 5:
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {kind}")
        if pos > len(buf):
            raise ValueError("truncated field")
        out.append((tag >> 3, kind, buf[start:pos]))
    return out


def _without_dummy_prefix(sp: Any) -> Any:
    """A copy of ``sp`` with normalizer_spec.add_dummy_prefix = false, for text that follows a special token.

    ModelProto field 3 is the NormalizerSpec, whose field 3 is add_dummy_prefix; the serialized model is edited
    at the wire level because the protobuf runtime is not a dependency.
    """
    import sentencepiece as spm

    proto = sp.serialized_model_proto()
    out = bytearray()
    for number, kind, raw in _fields(proto):
        if number == 3 and kind == 2:
            _, pos = _varint(raw, 0)
            n, pos = _varint(raw, pos)
            body = b"".join(r for num, _, r in _fields(raw[pos:pos + n]) if num != 3) + b"\x18\x00"
            raw = b"\x1a" + _encode_varint(len(body)) + body
        out += raw
    mid = spm.SentencePieceProcessor()
    mid.LoadFromSerializedProto(bytes(out))
    return mid


def from_file(path: Path, settings: TokenizerSettings) -> SentencePieceTokenizer:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(str(path))
        return SentencePieceTokenizer(sp, settings, str(path))
    except (OSError, RuntimeError, ValueError) as e:
        raise FormatError(str(path), f"not a valid SentencePiece model: {e}") from None
