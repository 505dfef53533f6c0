"""Tokenizers against transformers, fully offline: vocabularies are trained in-test next to tiny random llamas."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import sentencepiece as spm
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers.tokenization_utils_sentencepiece import SentencePieceExtractor

import inferflow
from inferflow.tokenizers.hf import from_source

CORPUS = ["hello world, this is a tiny test.", "héllo wörld 你好 🙂", "The quick brown fox jumps over the lazy dog!",
          "user: hi there", "assistant: hello!", "system: be nice and brief"]
TEXTS = CORPUS + ["héllo 你好 🙂 <s>hi</s> there", "two  spaces", "<s>hello", "a</s>b", "🙂🙂 wörld"]
CHAT = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "héllo"},
        {"role": "assistant", "content": "hi 🙂"}, {"role": "user", "content": "你好"}]
BPE_TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
                "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
                "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# Only characters of CORPUS, so the SentencePiece vocabulary has them all.
SP_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
               "{% if add_generation_prompt %}assistant:{% endif %}")


def tiny_llama(folder: Path, vocab: int, bos: int, eos: int) -> None:
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=bos, eos_token_id=eos)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)


def check_same(tok, ref, texts=TEXTS) -> None:
    for s in texts:
        ids = tok.encode(s)
        assert ids == ref.encode(s), s
        assert tok.encode(s, add_special_tokens=False) == ref.encode(s, add_special_tokens=False), s
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), s
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids), s
    rendered = tok.apply_chat_template(CHAT)
    assert rendered == ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tok.encode(rendered, add_special_tokens=False) == ref.encode(rendered, add_special_tokens=False)
    assert tok.apply_chat_template(CHAT[:2], add_generation_prompt=False) == \
        ref.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=False)


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory) -> Path:
    """Byte-level BPE (GPT-2 / Llama 3 style) with a BOS post-processor, chat template and generation_config."""
    folder = tmp_path_factory.mktemp("bpe")
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=["<s>", "</s>", "<pad>", "<eot>"],
                                                       show_progress=False))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                      special_tokens=[("<s>", 0)])
    assert tk.get_vocab_size() <= 120
    tk.save(str(folder / "tokenizer.json"))
    tiny_llama(folder, 120, bos=0, eos=1)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "chat_template": BPE_TEMPLATE}))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 3]}))
    return folder


def test_byte_level_bpe_matches_transformers(bpe_folder):
    m = inferflow.load(bpe_folder, spec="llama")
    tok, ref = m.tokenizer, transformers.AutoTokenizer.from_pretrained(bpe_folder)
    check_same(tok, ref)
    for s in TEXTS:
        assert tok.decode(tok.encode(s, add_special_tokens=False), skip_special_tokens=False) == s
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert tok.add_bos and not tok.add_eos
    assert tok.stop_ids == {1, 3} and tok.extra_eos_ids == (3,)
    # a multi-byte character decodes only once all its bytes are there
    ids = tok.encode("🙂", add_special_tokens=False)
    assert tok.decode(ids) == "🙂"
    out = m.generate("hello world", max_new_tokens=5)
    assert isinstance(out, str)


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("spm")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 3), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "tokenizer"), vocab_size=80,
                                   model_type="bpe", character_coverage=1.0, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2,
                                   hard_vocab_limit=False, minloglevel=2)
    corpus.unlink()
    (folder / "tokenizer.vocab").unlink()
    return folder / "tokenizer.model"


def llama_reference(model: Path, **kw) -> transformers.PreTrainedTokenizerBase:
    # What transformers builds from a .model (its converter needs protobuf, which the test machine lacks):
    # the .model's vocabulary and merges in a LlamaTokenizer (metaspace BPE, byte fallback).
    vocab, _, merges = SentencePieceExtractor(str(model)).extract()
    return transformers.LlamaTokenizer(vocab=vocab, merges=merges, legacy=False, add_bos_token=True, **kw)


def test_sentencepiece_model(sp_model, tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(sp_model.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": SP_TEMPLATE, "legacy": False}))
    tiny_llama(tmp_path, 96, bos=1, eos=2)
    m = inferflow.load(tmp_path, spec="llama")
    tok = m.tokenizer
    assert type(tok).__name__ == "SentencePieceTokenizer"
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>") and tok.add_bos
    check_same(tok, llama_reference(sp_model, chat_template=SP_TEMPLATE))
    for s in CORPUS:
        assert tok.decode(tok.encode(s)) == s
    assert isinstance(m.generate("hello world", max_new_tokens=5), str)


def test_metaspace_tokenizer_json(sp_model, tmp_path):
    """A sentencepiece-style tokenizer.json (Metaspace, byte fallback, Strip decoder) as transformers saves one."""
    llama_reference(sp_model, chat_template=SP_TEMPLATE).save_pretrained(tmp_path)
    tiny_llama(tmp_path, 96, bos=1, eos=2)
    tok = inferflow.load(tmp_path, spec="llama").tokenizer
    assert type(tok).__name__ == "HFTokenizer" and tok.add_bos
    check_same(tok, transformers.AutoTokenizer.from_pretrained(tmp_path))


def test_sentencepiece_byte_fallback(tmp_path):
    """Characters outside the vocabulary go through <0x..> byte pieces and decode back to whole characters."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS * 3), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "tokenizer"), vocab_size=300,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   hard_vocab_limit=False, minloglevel=2)
    tok = from_source(SimpleNamespace(folder=tmp_path), None)
    ref = llama_reference(tmp_path / "tokenizer.model")
    for s in ["naïve café €5 日本語 🙂👍", "hello wörld", "Ωmega"]:
        ids = tok.encode(s)
        assert ids == ref.encode(s) and tok.decode(ids) == s == ref.decode(ids, skip_special_tokens=True)
    assert sum(tok.id_to_token(i).startswith("<0x") for i in tok.encode("日本語 🙂👍")) >= 10


def test_spec_overrides(bpe_folder):
    spec = {"tokenizer": {"add_bos": "${add}", "add_eos": True, "eos_token": "<eot>", "extra_eos_tokens": ["<pad>"]},
            "chat_template": "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"}
    tok = from_source(SimpleNamespace(folder=bpe_folder), spec, {"add": False})
    assert not tok.add_bos and tok.add_eos and tok.eos_token_id == 3
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False) + [3]
    assert tok.stop_ids == {1, 2, 3}
    assert tok.apply_chat_template(CHAT[:2]) == "be nice<eot>héllo<eot>"
    assert from_source(SimpleNamespace(folder=bpe_folder), {"tokenizer": {"files": ["nothing.json"]}}) is None
    with pytest.raises(inferflow.SpecError):
        from_source(SimpleNamespace(folder=bpe_folder), {"tokenizer": {"files": ["../escape.json"]}})
    assert from_source(SimpleNamespace(), None) is None


def test_partial_spec_overrides(bpe_folder):
    tok = from_source(SimpleNamespace(folder=bpe_folder), {"tokenizer": {"add_eos": True}, "chat_template": None})
    assert tok.add_bos and tok.add_eos  # the file's BOS stays
    assert tok.encode("hi") == [0] + tok.encode("hi", add_special_tokens=False) + [1]
    with pytest.raises(inferflow.InferflowError, match="no chat template"):
        tok.apply_chat_template(CHAT)
