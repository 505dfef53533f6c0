"""Tokenizers rebuilt from GGUF metadata match the tokenizers they were exported from."""
import io
import json

import gguf
import pytest
import torch
import transformers

import inferflow
from gguf_files import Q, write_llama
from inferflow.loaders.gguf import GGUFSource
from inferflow.tokenizers.gguf import from_gguf

CORPUS = [
    "The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris is.",
    "def add(a, b):\n    return a + b\n", "Numbers like 12345 and 2024-01-31, 3.14159.",
    "Hello, world! It's a test; we're checking don't and I'll.", "  indented   text\twith\ttabs\n\nand newlines",
    "café naïve résumé über straße", "привет мир", "日本語のテキスト", "emoji 🙂 ok",
] * 20
TEXTS = ["Hello world", "  two  spaces and\n\nnew lines\t", "digits 1234567 and 3.5", "unseen: ζ ẞ 😀 ☃",
         "<|im_start|>user\nHi there<|im_end|>\n", "I'll say it's fine", "", " leading space"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


def write_vocab(path, fill) -> GGUFSource:
    w = gguf.GGUFWriter(str(path), "llama")
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return GGUFSource(path)


def byte_level(pre: str):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    steps = {
        "gpt2": [pre_tokenizers.ByteLevel(add_prefix_space=False)],
        "smollm": [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)],
        "llama-bpe": [pre_tokenizers.Split(Regex(_LLAMA3), "isolated"),
                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)],
        "qwen2": [pre_tokenizers.Split(Regex(_QWEN2), "isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)],
    }[pre]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    data = json.loads(tok.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    if pre == "llama-bpe":  # as HF's Llama 3 tokenizer.json
        data["model"]["ignore_merges"] = True
        tok = Tokenizer.from_str(json.dumps(data))
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    return tok, tokens, merges


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "llama-bpe", "qwen2"])
def test_byte_level_bpe_matches_source(tmp_path, pre):
    ref, tokens, merges = byte_level(pre)
    im_end = tokens.index("<|im_end|>")

    def fill(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(im_end)
        w.add_add_bos_token(False)
        w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")

    tok = from_gguf(write_vocab(tmp_path / "v.gguf", fill))
    assert tok.vocab_size == len(tokens) and tok.eos_token_id == im_end and not tok.add_bos
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text).ids, (pre, text)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"  # control tokens are special
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x<|im_end|>"


def test_unknown_pre_tokenizer_warns(tmp_path):
    _, tokens, merges = byte_level("gpt2")

    def fill(w):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("some-new-model")
        w.add_token_list(tokens)
        w.add_token_merges(merges)

    with pytest.warns(UserWarning, match="some-new-model"):
        assert from_gguf(write_vocab(tmp_path / "v.gguf", fill)).encode("hi there") != []


def sentencepiece_model():
    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=out, vocab_size=420, model_type="bpe",
                                   byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_digits=True, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=out.getvalue())


def spm_metadata(sp):
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i)
             else 1 for i in range(sp.get_piece_size())]

    def fill(w):
        w.add_tokenizer_model("llama")
        w.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
        w.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
        w.add_token_types(types)
        w.add_bos_token_id(sp.bos_id())
        w.add_eos_token_id(sp.eos_id())
        w.add_unk_token_id(sp.unk_id())
        w.add_eot_token_id(sp.eos_id() + 1)
    return fill


def test_sentencepiece_vocab_matches_sentencepiece(tmp_path):
    sp = sentencepiece_model()
    tok = from_gguf(write_vocab(tmp_path / "spm.gguf", spm_metadata(sp)))
    assert tok.add_bos and tok.bos_token_id == sp.bos_id() and tok.eos_token_id == sp.eos_id()
    assert sp.eos_id() + 1 in tok.stop_ids
    for text in TEXTS[:4] + TEXTS[5:]:
        ids = tok.encode(text)
        assert ids == [sp.bos_id()] + sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids[1:]) == text
    assert tok.encode("ζ", add_special_tokens=False) == sp.encode("ζ")  # byte fallback


def test_model_with_gguf_tokenizer(tmp_path):
    sp = sentencepiece_model()
    cfg = transformers.LlamaConfig(vocab_size=sp.get_piece_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    fill = spm_metadata(sp)

    def extra(w):
        fill(w)
        w.add_chat_template("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")

    write_llama(ref, tmp_path / "m.gguf", Q.Q8_0, extra=extra)
    m = inferflow.load(tmp_path / "m.gguf")
    assert m.tokenizer is not None and m.tokenizer.eos_token_id == sp.eos_id()
    assert m.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[user] hi"
    assert isinstance(m.generate("The quick", max_new_tokens=3), str)
