"""Tiny random models with tokenizers that can write JSON, for the guided-decoding tests (built offline).

- ``json_llama``: a random 2-layer llama with a byte-level BPE (vocab 180) trained on JSON text, so its tokens
  are multi-character pieces ('{"', '":', ...), and multi-byte characters (é, 你, 🙂) are split across byte
  tokens; its chat template is ChatML with Hermes-style tools (``<tool_call>...</tool_call>``).
- ``gguf_llama``: a random llama whose vocabulary is the embedded default model's real 49k byte-level BPE.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

import inferflow
from parity import DEVICE
from service_helpers import chatml_bpe, tiny_llama_config

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> Answer with "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}" + CHATML)
CORPUS = ['{"name": "Paris", "age": 42, "ok": true, "x": null, "f": false}',
          '{"city": "héllo wörld 你好 🙂", "temp": -3.5e+2, "tags": ["a", "b"], "v": [1.0E-9, 0]}',
          '{"q": "the quick brown fox jumps over the lazy dog\\n\\t\\"\\\\/", "u": "\\u00e9"}',
          "<tool_call>\n</tool_call> [TOOL_CALLS] user assistant system json JSON weather", "{}[],:",
          "".join(chr(c) for c in range(32, 127))]  # every printable ASCII character is a token


def json_tokenizer(folder: Path) -> int:
    """Train and save the byte-level BPE; returns its vocabulary size."""
    tk = chatml_bpe(180, CORPUS)
    tk.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
        "chat_template": TOOLS_TEMPLATE}))
    return tk.get_vocab_size()


def _config(vocab: int, **kw) -> transformers.LlamaConfig:
    return tiny_llama_config(vocab, **{"intermediate_size": 48, "max_position_embeddings": 1024, **kw})


def json_folder(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    vocab = json_tokenizer(folder)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(_config(vocab, bos_token_id=0, eos_token_id=1)).save_pretrained(folder)
    return folder


def json_llama(folder: Path, seed: int = 0) -> inferflow.Model:
    return inferflow.load(json_folder(folder, seed), dtype="float32", device=DEVICE)


def gguf_llama(folder: Path) -> inferflow.Model:
    """A random llama over the default model's 49152-token byte-level BPE (tokenizer read from its GGUF)."""
    from inferflow.default_model import default_model_path
    from inferflow.loaders.gguf import GGUFSource
    from inferflow.tokenizers.gguf import from_gguf

    tok = from_gguf(GGUFSource(default_model_path()))
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = _config(tok.vocab_size, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  max_position_embeddings=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    m = inferflow.load(folder, spec="llama", dtype="float32", device=DEVICE)
    m.tokenizer = tok
    return m
