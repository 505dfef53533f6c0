"""llama2.c's ``tokenizer.bin``: scored pieces, encoded with run.c's greedy best-score pair merging.

File: u32 max_token_length, then per token f32 score, i32 length, bytes. The vocabulary size is not
stored; it comes from the model header (or the file is read to its end). Export rewrote '▁' to ' ' and
BOS/EOS to "\\n<s>\\n" / "\\n</s>\\n"; byte-fallback pieces stay literal "<0xNN>" (id = byte + 3).
"""
from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Any, Sequence

from ..errors import FormatError
from .base import Tokenizer

BOS, EOS = 1, 2
_BYTE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


class Llama2cTokenizer(Tokenizer):
    """Encoding and decoding exactly as llama2.c's run.c does (BOS added, no EOS)."""

    def __init__(self, path: str | Path, vocab_size: int | None = None):
        self.path = str(path)
        self.pieces, self.scores = read_tokenizer_bin(self.path, vocab_size)
        self.lookup: dict[bytes, int] = {}
        for i, p in enumerate(self.pieces):
            self.lookup.setdefault(p, i)
        self.unk_token_id, self.bos_token_id, self.eos_token_id = 0, BOS, EOS
        self.bos_token, self.eos_token = self.id_to_token(BOS), self.id_to_token(EOS)
        self.add_bos, self.add_eos = True, False
        self.extra_eos_ids = (BOS,)  # run.c stops generating at BOS: it delimits sequences

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        if text and b" " in self.lookup:  # the dummy prefix SentencePiece adds
            ids.append(self.lookup[b" "])
        for ch in text:  # one lookup per code point, raw bytes (+3) when the vocab lacks it
            b = ch.encode("utf-8", "surrogatepass")
            idx = self.lookup.get(b)
            ids.extend([idx] if idx is not None else [c + 3 for c in b])
        if add_special_tokens and self.add_bos:
            ids.insert(0, BOS)
        while True:  # merge the adjacent pair whose concatenation scores best; ties go to the leftmost
            best, best_i, best_id = float("-inf"), -1, -1
            for i in range(len(ids) - 1):
                idx = self.lookup.get(self.pieces[ids[i]] + self.pieces[ids[i + 1]])
                if idx is not None and self.scores[idx] > best:
                    best, best_i, best_id = self.scores[idx], i, idx
            if best_i < 0:
                break
            ids[best_i:best_i + 2] = [best_id]
        if add_special_tokens and self.add_eos:
            ids.append(EOS)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, prev = bytearray(), None
        for idx in ids:
            idx = int(idx)
            if not 0 <= idx < len(self.pieces):
                raise FormatError(self.path, f"token id {idx} outside the vocabulary of {len(self.pieces)}")
            piece = self.pieces[idx]
            if prev == BOS and piece.startswith(b" "):
                piece = piece[1:]
            prev = idx
            if skip_special_tokens and idx in (BOS, EOS):
                continue
            m = _BYTE.fullmatch(piece)
            out += bytes([int(m.group(1), 16)]) if m else piece
        return out.decode("utf-8", "replace")

    def token_to_id(self, token: str) -> int | None:
        return self.lookup.get(token.encode("utf-8", "surrogatepass"))

    def id_to_token(self, idx: int) -> str | None:
        return self.pieces[idx].decode("utf-8", "replace") if 0 <= idx < len(self.pieces) else None

    def __repr__(self) -> str:
        return f"Llama2cTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def read_tokenizer_bin(path: str, vocab_size: int | None = None) -> tuple[list[bytes], list[float]]:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise FormatError(path, f"cannot read: {e}") from None
    if len(data) < 4:
        raise FormatError(path, "too short for a llama2.c tokenizer.bin")
    (max_len,) = struct.unpack_from("<I", data, 0)
    pos, pieces, scores = 4, [], []
    while pos < len(data) and (vocab_size is None or len(pieces) < vocab_size):
        if pos + 8 > len(data):
            raise FormatError(path, f"truncated at token {len(pieces)}")
        score, n = struct.unpack_from("<fi", data, pos)
        if n < 0 or n > max_len or pos + 8 + n > len(data):
            raise FormatError(path, f"token {len(pieces)}: length {n} exceeds max_token_length {max_len} or the file")
        pieces.append(data[pos + 8:pos + 8 + n])
        scores.append(score)
        pos += 8 + n
    if vocab_size is not None and len(pieces) < vocab_size:
        raise FormatError(path, f"holds {len(pieces)} tokens, the model needs {vocab_size}")
    if len(pieces) <= EOS:
        raise FormatError(path, "fewer than 3 tokens (<unk>, BOS, EOS)")
    return pieces, scores


def from_source(src: Any) -> Llama2cTokenizer | None:
    """The tokenizer.bin beside a llama2.c checkpoint, sized by the model's vocabulary (None if absent)."""
    path = Path(src.path)
    tok = (path if path.is_dir() else path.parent) / "tokenizer.bin"
    if not tok.is_file() or tok.resolve() == path.resolve():
        return None
    return Llama2cTokenizer(tok, src.config.get("vocab_size"))
