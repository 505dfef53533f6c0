"""Tiny models built offline for the service tests, and a real uvicorn server on a free 127.0.0.1 port.

- ``chat_llama``: a random 2-layer llama with a byte-level BPE tokenizer and a ChatML template (general routes).
- ``successor_llama``: a llama whose greedy continuation is a chosen token chain: attention and MLP outputs are
  zeroed, so the logits depend only on the current token's embedding; chain tokens get one-hot embeddings and
  the head maps each one to its successor. With a word-level or bytes-only tokenizer this makes the model write
  an exact text (a tool call, multi-byte characters split across tokens).
- ``tiny_bert``: a random encoder with a WordPiece tokenizer (embeddings).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> Answer with "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}" + CHATML)
CORPUS = ["hello world, this is a tiny test.", "héllo wörld 你好 🙂", "The quick brown fox jumps over the lazy dog!",
          "user: hi there", "assistant: hello!", "system: be nice and brief", "what is the weather in Paris?"]


def chatml_bpe(vocab_size: int, corpus: list[str] = CORPUS) -> Tokenizer:
    """A byte-level BPE trained on ``corpus`` with ChatML's specials (<s> 0, <|im_end|> 1, <|im_start|> 2)."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "<|im_end|>",
                                                                                             "<|im_start|>"],
                                                       show_progress=False))
    return tk


def tiny_llama_ref(vocab: int, seed: int = 0, **kw) -> transformers.LlamaForCausalLM:
    """A seeded random tiny llama (HF reference model, eval mode) of :func:`tiny_llama_config`'s shape."""
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_llama_config(vocab, **kw)).eval()


def tiny_llama_config(vocab: int, **kw) -> transformers.LlamaConfig:
    base = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    return transformers.LlamaConfig(**{**base, **kw})


def chat_llama(folder: Path, seed: int = 0) -> Path:
    """Random llama (context 128) + byte-level BPE (vocab <= 120) + ChatML; EOS is <|im_end|>."""
    folder.mkdir(parents=True, exist_ok=True)
    tk = chatml_bpe(120)
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tk.save(str(folder / "tokenizer.json"))
    vocab = tk.get_vocab_size()
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(tiny_llama_config(vocab, bos_token_id=0, eos_token_id=1)).save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
        "chat_template": CHATML}))
    return folder


def successor_llama(folder: Path, tk: Tokenizer, chain: list[int], eos: int, *, bos: int = 0,
                    config: dict | None = None) -> Path:
    """Save a llama whose greedy output after ``chain[0]`` is ``chain[1:]`` then ``eos``."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab = tk.get_vocab_size()
    hidden = 64
    assert len(chain) == len(set(chain)) and len(chain) <= hidden, "a bigram chain needs distinct tokens"
    cfg = tiny_llama_config(vocab, hidden_size=hidden, intermediate_size=64, bos_token_id=bos, eos_token_id=eos)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for slot, tok in enumerate(chain):
            model.model.embed_tokens.weight[tok, slot] = 1.0
            nxt = chain[slot + 1] if slot + 1 < len(chain) else eos
            model.lm_head.weight[nxt, slot] = 10.0
    model.save_pretrained(folder)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              **(config or {})}))
    return folder


TOOL_PIECES = ["<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "</tool_call>"]


def tool_llama(folder: Path) -> Path:
    """Word-level vocabulary; greedy output after the generation prompt is exactly one Hermes tool call."""
    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "What", "weather", "Paris?"]
    vocab = {w: i for i, w in enumerate(words + TOOL_PIECES)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    chain = [vocab["assistant"]] + [vocab[p] for p in TOOL_PIECES]
    return successor_llama(folder, tk, chain, eos=vocab["<|im_end|>"], bos=vocab["<|im_start|>"],
                           config={"eos_token": "<|im_end|>", "chat_template": TOOLS_TEMPLATE})


UTF8_TEXT = "🙂é你"   # 9 distinct UTF-8 bytes: every character is split across byte tokens


def bytes_llama(folder: Path) -> Path:
    """Byte-level vocabulary without merges (ASCII letters, space, the bytes of UTF8_TEXT); greedy output after a
    prompt ending in "i" is UTF8_TEXT, one byte per token; no chat template (the native route encodes text)."""
    b2u = pre_tokenizers.ByteLevel.alphabet()
    table = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    assert set(table.values()) == set(b2u)
    needed = sorted(set(b" abcdefghijklmnopqrstuvwxyz?") | set(UTF8_TEXT.encode()))
    vocab = {"<s>": 0, "</s>": 1, **{table[b]: i + 2 for i, b in enumerate(needed)}}
    tk = Tokenizer(models.BPE(vocab, [], unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<s>", "</s>"])
    chain = [vocab[table[ord("i")]]] + [vocab[table[b]] for b in UTF8_TEXT.encode()]
    return successor_llama(folder, tk, chain, eos=1, bos=0, config={"bos_token": "<s>", "eos_token": "</s>"})


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def tiny_bert(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "the", "cat", "sat", "on", "mat", "a",
             "dog", "!", ".", ","]
    tk = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.decoder = decoders.WordPiece()
    tk.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2),
                                                                                              ("[SEP]", 3)])
    tk.save(str(folder / "tokenizer.json"))
    cfg = transformers.BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                              "cls_token": "[CLS]", "sep_token": "[SEP]"}))
    return folder


# the tests serve through the same in-process server `inferflow bench` uses
from inferflow.service.threaded import ThreadedServer as LiveServer, free_port  # noqa: E402,F401


API_KEY = "sk-test"


@pytest.fixture(scope="session")
def live(tmp_path_factory):
    """One server for the route tests: "tiny" (random chat llama, context 128), "tools" (writes a tool call),
    "bytes" (writes multi-byte characters), "embed" (tiny BERT); API key sk-test; 64 KiB body limit; CORS."""
    from inferflow.service import config_from_dict, create_app

    root = tmp_path_factory.mktemp("served")
    cfg = config_from_dict({
        "api_keys": [API_KEY], "max_body_bytes": 65536, "cors": {"allow_origins": ["http://app.example"]},
        "models": [
            {"name": "tiny", "source": str(chat_llama(root / "tiny")), "engine": {"max_num_seqs": 8}},
            {"name": "tools", "source": str(tool_llama(root / "tools"))},
            {"name": "bytes", "source": str(bytes_llama(root / "bytes"))},
            {"name": "embed", "source": str(tiny_bert(root / "embed"))},
        ]})
    app = create_app(cfg)
    with LiveServer(app) as srv:
        srv.app = app
        srv.state = app.state.service
        yield srv
