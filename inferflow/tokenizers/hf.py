"""HF fast tokenizers: tokenizer.json through the `tokenizers` library, set up the way transformers sets it up."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..errors import FormatError
from .base import Tokenizer
from .settings import TokenizerSettings, read_settings

# Folder files tried in order when the spec names none; .json files go to `tokenizers`, .model to sentencepiece.
DEFAULT_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model")


def _cleanup(text: str) -> str:
    # transformers' clean_up_tokenization, for WordPiece vocabularies that split off punctuation
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` (byte-level BPE, metaspace/sentencepiece-style BPE or Unigram, WordPiece, ...)."""

    def __init__(self, backend: Any, settings: TokenizerSettings, path: str = ""):
        from tokenizers import AddedToken

        self.backend, self.path = backend, path
        # tokenizer.json may carry truncation/padding for training; encoding one text must never cut or pad it.
        backend.no_truncation()
        backend.no_padding()
        # Like transformers: added tokens listed only in tokenizer_config.json, and named special tokens that are
        # not yet added tokens, become (special) added tokens, so they match in text and decode(skip) drops them.
        have = {t.content for t in backend.get_added_tokens_decoder().values()}
        for tok in (settings.added_tokens[i] for i in sorted(settings.added_tokens)):
            if tok["content"] not in have:
                kw = {k: tok[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in tok}
                backend.add_tokens([AddedToken(tok["content"], **kw)])
                have.add(tok["content"])
        for text in [v for v in settings.special.values() if v] + settings.extra_special:
            if text not in have:
                backend.add_special_tokens([AddedToken(text, special=True)])
                have.add(text)
        settings.apply(self)
        self._cleanup = settings.clean_up_spaces and type(backend.model).__name__ != "BPE"
        self._probe()
        if settings.add_bos is not None or settings.add_eos is not None:
            # The spec's add_bos/add_eos replace the file's template (what transformers does for explicit
            # add_bos_token/add_eos_token); the one it leaves out keeps the file's behaviour.
            self._set_post_processor(self.add_bos if settings.add_bos is None else settings.add_bos,
                                     self.add_eos if settings.add_eos is None else settings.add_eos)
            self._probe()

    def _probe(self) -> None:
        # What encoding adds is decided by the (file's or rebuilt) post-processor; record it for callers.
        probe = self.backend.encode("", add_special_tokens=True).ids
        self.add_bos = bool(probe) and probe[0] == self.bos_token_id
        self.add_eos = bool(probe) and probe[-1] == self.eos_token_id and (len(probe) > 1 or not self.add_bos)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        # transformers' update_post_processor: an explicit add_bos_token/add_eos_token replaces the file's template.
        from tokenizers import processors

        bos, eos = self.bos_token, self.eos_token
        add_bos = add_bos and bos is not None and self.bos_token_id is not None
        add_eos = add_eos and eos is not None and self.eos_token_id is not None
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
        specials = ([(bos, self.bos_token_id)] if add_bos else []) + ([(eos, self.eos_token_id)] if add_eos else [])
        self.backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # The file's decoder reassembles byte-level pieces into whole UTF-8 characters and turns metaspace
        # markers back into spaces; ids the vocabulary lacks (padded embedding rows) are skipped, not fatal.
        n = self.vocab_size
        text = self.backend.decode([int(i) for i in ids if 0 <= int(i) < n], skip_special_tokens=skip_special_tokens)
        return _cleanup(text) if self._cleanup else text

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self.backend.id_to_token(int(idx))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def from_file(path: Path, settings: TokenizerSettings) -> HFTokenizer:
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception for malformed files
        raise FormatError(str(path), f"not a valid tokenizer.json: {e}") from None
    return HFTokenizer(backend, settings, str(path))


def from_source(src: Any, spec: Any, params: dict[str, Any] | None = None) -> Tokenizer | None:
    """The tokenizer in the model folder of ``src`` (tokenizer.json, else a SentencePiece model), with the spec's
    overrides applied; None when the source has no folder or the folder no tokenizer file."""
    folder = getattr(src, "folder", None)
    if folder is None:
        return None
    settings = read_settings(Path(folder), spec, params)
    path = settings.file(DEFAULT_FILES)
    if path is None:
        return None
    if path.suffix == ".json":
        return from_file(path, settings)
    if path.suffix == ".model":
        from .sentencepiece import from_file as sp_from_file

        return sp_from_file(path, settings)
    raise FormatError(str(path), "unknown tokenizer file kind (expected tokenizer.json or a SentencePiece .model)")
