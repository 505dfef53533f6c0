"""The bytes each token adds to the output, computed once per tokenizer (cached on it).

Decoding one token at a time is wrong for the matcher: byte-level BPE tokens may hold half a UTF-8 character
(decode gives U+FFFD) and SentencePiece decoders drop a leading space. So the table is read from the vocabulary:
- byte-level BPE (the tokenizer's decoder is ByteLevel): each piece character maps back to its byte through
  GPT-2's byte <-> printable-character table;
- SentencePiece-style pieces (Metaspace, or Replace "▁" + ByteFallback decoders, and the sentencepiece backend):
  "▁" is a space and ``<0xNN>`` is byte NN;
- anything else: ``decode([id])`` when it is whole text.
Special tokens (and anything that decodes to nothing) get None: guided decoding never writes them; EOS and
stop tokens are handled apart. Added tokens that are not special are their literal text.
"""
from __future__ import annotations

import json
import re
from typing import Any

import torch

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_ATTR = "_guided_token_bytes"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable character -> byte table."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _decoder_kind(tok: Any) -> str:
    backend = getattr(tok, "backend", None)
    if backend is None:
        return "pieces" if hasattr(tok, "sp") else "decode"
    dec = getattr(backend, "decoder", None)
    if dec is None:
        return "decode"
    try:
        text = json.dumps(json.loads(dec.__getstate__()))
    except Exception:  # noqa: BLE001 - an opaque decoder: decode token by token
        return "decode"
    if '"ByteLevel"' in text:
        return "byte_level"
    return "pieces" if any(k in text for k in ('"Metaspace"', '"ByteFallback"', "\\u2581")) else "decode"


def _special_ids(tok: Any) -> set[int]:
    ids = {getattr(tok, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    ids |= set(getattr(tok, "stop_ids", ()) or ())
    backend = getattr(tok, "backend", None)
    if backend is not None:
        ids |= {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    ids |= set(getattr(tok, "_special_ids", ()) or ())
    return {i for i in ids if isinstance(i, int)}


def _added_text(tok: Any) -> dict[int, str]:
    backend = getattr(tok, "backend", None)
    if backend is None:
        return dict(getattr(tok, "_added_text", {}) or {})
    return {i: t.content for i, t in backend.get_added_tokens_decoder().items() if not t.special}


def build_table(tok: Any, size: int) -> list[bytes | None]:
    """Bytes of every token id below ``size`` (None: never written by guided decoding)."""
    kind = _decoder_kind(tok)
    special, added = _special_ids(tok), _added_text(tok)
    n = min(size, int(tok.vocab_size))
    table: list[bytes | None] = [None] * size
    bd = _byte_decoder() if kind == "byte_level" else None
    for i in range(n):
        if i in special:
            continue
        if i in added:
            table[i] = added[i].encode("utf-8") or None
            continue
        data: bytes | None = None
        piece = tok.id_to_token(i) if kind != "decode" else None
        if bd is not None and piece is not None and all(ch in bd for ch in piece):
            data = bytes(bd[ch] for ch in piece)
        elif kind == "pieces" and piece is not None:
            m = _BYTE_PIECE.match(piece)
            data = bytes((int(m.group(1), 16),)) if m else piece.replace("\u2581", " ").encode("utf-8")
        else:
            text = tok.decode([i], skip_special_tokens=True)
            data = text.encode("utf-8") if text and "\ufffd" not in text else None
        table[i] = data or None
    return table


class TokenTable:
    """Token bytes plus, as tensors, each token's first two bytes (256: none), length and whether it is only
    whitespace, for the guide's vectorised filters."""

    __slots__ = ("data", "first", "second", "length", "blank")

    def __init__(self, data: list[bytes | None]):
        self.data = data
        self.first = torch.tensor([d[0] if d else 256 for d in data], dtype=torch.long)
        self.second = torch.tensor([d[1] if d and len(d) > 1 else 256 for d in data], dtype=torch.long)
        self.length = torch.tensor([len(d) if d else 0 for d in data], dtype=torch.long)
        self.blank = torch.tensor([bool(d) and not d.strip(b" \t\r\n") for d in data])  # whitespace only

    def __len__(self) -> int:
        return len(self.data)


def token_table(tok: Any, size: int) -> TokenTable:
    """``build_table`` cached on the tokenizer (one table per tokenizer, grown for a larger ``size``)."""
    table = getattr(tok, _ATTR, None)
    if table is None or len(table) < size:
        table = TokenTable(build_table(tok, size))
        try:
            setattr(tok, _ATTR, table)
        except AttributeError:  # a slotted tokenizer: no cache, build per call
            pass
    return table
