"""Tokenizers rebuilt from GGUF metadata (``tokenizer.ggml.*``) as `tokenizers` pipelines.

Two vocabulary kinds are supported, named by ``tokenizer.ggml.model``:
- ``gpt2``: byte-level BPE from ``tokens`` + ``merges``; the pre-tokenizer regex comes from
  ``tokenizer.ggml.pre`` (llama.cpp's pre-tokenizer ids, the same regexes as the HF tokenizer.json files).
- ``llama``: SentencePiece-style BPE from ``tokens`` + ``scores``: the pair whose merged piece scores
  highest merges first (llama.cpp's SPM tokenizer), spaces become "▁", byte fallback through <0xNN> pieces.
Control tokens (token_type 3) become special added tokens, user-defined ones (4) plain added tokens.
"""
from __future__ import annotations

import warnings
from typing import Any

from ..errors import FormatError
from .base import Tokenizer
from .settings import read_settings

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = None  # ByteLevel's built-in regex
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (regex, digits split one by one first, ignore_merges), after llama-vocab.cpp
_PRE: dict[str, tuple[str | None, bool, bool]] = {
    **{k: (_GPT2, False, False) for k in ("default", "gpt2", "gpt-2", "phi-2", "olmo", "roberta-bpe", "jina-es",
                                           "jina-de", "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code",
                                           "gigachat")},
    **{k: (_LLAMA3, False, True) for k in ("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe",
                                           "pixtral")},
    **{k: (_QWEN2, False, False) for k in ("qwen2", "deepseek-r1-qwen", "megrez")},
    **{k: (_GPT2, True, False) for k in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                                         "minerva-7b")},
}


def _meta(src: Any, key: str, default: Any = None) -> Any:
    v = src.config.get(key)
    return default if v is None else v


def _token_id(src: Any, key: str, n: int) -> int | None:
    v = src.config.get(f"tokenizer.ggml.{key}")
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n else None


def _byte_level(tokens: list[str], merges: list[str], pre: str, path: str) -> Any:
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    if pre not in _PRE:
        warnings.warn(f"{path}: GGUF pre-tokenizer {pre!r} is not known here; using the GPT-2 regex "
                      f"(text with digits, CJK or unusual spacing may tokenize differently)", stacklevel=3)
    regex, digits, ignore_merges = _PRE.get(pre, _PRE["default"])
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise FormatError(path, f"tokenizer.ggml.merges: entry {m!r} is not 'left right'")
        pairs.append((a, b))
    backend = Backend(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(tokens: list[str], scores: list[float], types: list[int], unk: int | None,
                   add_space_prefix: bool) -> Any:
    from tokenizers import decoders, models, normalizers
    from tokenizers import Tokenizer as Backend

    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    # Merge ranks from scores: every split of a normal piece into two known pieces is a merge, ranked by
    # the merged piece's score (highest first), as HF's SentencePiece converter does.
    found = []
    for piece, idx in vocab.items():
        if types[idx] not in (NORMAL, USER_DEFINED, UNUSED):
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                found.append((-scores[idx], vocab[left], vocab[right], left, right))
    found.sort()
    unk_token = tokens[unk] if unk is not None else None
    backend = Backend(models.BPE(vocab, [(f[3], f[4]) for f in found], unk_token=unk_token, fuse_unk=True,
                                 byte_fallback=True))
    # llama.cpp prefixes a space to every run of text (the start and after each special token): the
    # Prepend normalizer runs on each segment between added tokens, which is the same thing.
    norm = [normalizers.Prepend("▁")] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*norm, normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    return backend


def from_gguf(src: Any, spec: Any = None, params: dict[str, Any] | None = None) -> Tokenizer | None:
    """The tokenizer described by a GGUF source's metadata (None when it has none); the spec's
    ``tokenizer:`` / ``chat_template:`` sections override what the file says."""
    from tokenizers import AddedToken

    from .hf import HFTokenizer

    kind = _meta(src, "tokenizer.ggml.model")
    if kind in (None, "none", "no_vocab"):
        return None
    tokens = src.array("tokenizer.ggml.tokens")
    if not tokens or not all(isinstance(t, str) for t in tokens):
        raise FormatError(src.path, "tokenizer.ggml.tokens: missing, empty or not a list of strings")
    n = len(tokens)
    types = src.array("tokenizer.ggml.token_type") or [NORMAL] * n
    if len(types) != n:
        raise FormatError(src.path, f"tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")
    if kind == "gpt2":
        backend = _byte_level(tokens, src.array("tokenizer.ggml.merges") or [], _meta(src, "tokenizer.ggml.pre",
                                                                                      "default"), src.path)
        default_bos = _meta(src, "tokenizer.ggml.pre") in ("llama3", "llama-v3", "llama-bpe")
    elif kind == "llama":
        scores = src.array("tokenizer.ggml.scores")
        if scores is None or len(scores) != n:
            raise FormatError(src.path, "tokenizer.ggml.scores: the SentencePiece vocabulary needs one score per token")
        backend = _sentencepiece(tokens, scores, types, _token_id(src, "unknown_token_id", n),
                                 bool(_meta(src, "tokenizer.ggml.add_space_prefix", True)))
        default_bos = True
    else:
        warnings.warn(f"{src.path}: GGUF tokenizer model {kind!r} is not supported (gpt2, llama); "
                      f"the model loads without a tokenizer", stacklevel=2)
        return None
    backend.add_tokens([AddedToken(tokens[i], normalized=False) for i in range(n) if types[i] == USER_DEFINED])
    backend.add_special_tokens([AddedToken(tokens[i], normalized=False, special=True)
                                for i in range(n) if types[i] == CONTROL])

    s = read_settings(None, spec, params)  # the spec's overrides first; the file fills the gaps
    ids = {name: _token_id(src, key, n) for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                                                          ("unk_token", "unknown_token_id"),
                                                          ("pad_token", "padding_token_id"))}
    for name, idx in ids.items():
        if name not in s.special and idx is not None:
            s.special[name] = tokens[idx]
    if s.add_bos is None:
        s.add_bos = bool(_meta(src, "tokenizer.ggml.add_bos_token", default_bos)) and ids["bos_token"] is not None
    if s.add_eos is None:
        s.add_eos = bool(_meta(src, "tokenizer.ggml.add_eos_token", False)) and ids["eos_token"] is not None
    s.eos_ids += [i for i in (_token_id(src, "eot_token_id", n), _token_id(src, "eom_token_id", n)) if i is not None]
    if s.chat_templates is None:
        named = {k.rsplit(".", 1)[1]: v for k, v in src.config.items()
                 if k.startswith("tokenizer.chat_template.") and isinstance(v, str)}
        main = src.config.get("tokenizer.chat_template")
        s.chat_templates = {**({"default": main} if isinstance(main, str) else {}), **named} or None
    tok = HFTokenizer(backend, s, src.path)
    return tok
