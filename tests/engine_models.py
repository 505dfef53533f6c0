"""Tiny models, a character tokenizer and request mixes shared by the engine tests."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

import inferflow
from inferflow.tokenizers.base import Tokenizer
from parity import DEVICE, save

VOCAB = 96


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models spend their time in per-op overhead; on a busy shared CPU, 2-thread kernels wait on each
    other at every op (seen: 0.5 s -> 14 s for the same loop), so these tests run single-threaded."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class CharTokenizer(Tokenizer):
    """One token per printable character: ids 3.. map to chr(29 + id); 0 pad, 1 bos, 2 eos."""

    eos_token_id = 2
    bos_token_id = 1
    pad_token_id = 0

    @property
    def vocab_size(self) -> int:
        return VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + (ord(c) - 32) % (VOCAB - 3) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(29 + i) if i >= 3 else ("" if skip_special_tokens else f"<{i}>") for i in ids)

    def token_to_id(self, token: str) -> int | None:
        return self.encode(token)[0] if len(token) == 1 else None

    def id_to_token(self, idx: int) -> str | None:
        return self.decode([idx], skip_special_tokens=False)


def _perturb(model: torch.nn.Module, scale: float = 0.05) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


def llama(tmp: Path, **kw) -> inferflow.Model:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **kw)
    torch.manual_seed(0)
    m = inferflow.load(save(transformers.LlamaForCausalLM(cfg).eval(), tmp), dtype="float32", device=DEVICE)
    m.tokenizer = CharTokenizer()
    return m


def mixtral(tmp: Path) -> inferflow.Model:
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                     num_local_experts=4, num_experts_per_tok=2, sliding_window=12)
    torch.manual_seed(0)
    ref = transformers.MixtralForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a sharp router spreads tokens over the experts
        for layer in ref.model.layers:
            layer.mlp.gate.weight.copy_(torch.randn(layer.mlp.gate.weight.shape, generator=g))
    return inferflow.load(save(ref, tmp), dtype="float32", device=DEVICE)


def t5(tmp: Path) -> inferflow.Model:
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                decoder_start_token_id=0)
    torch.manual_seed(0)
    return inferflow.load(save(_perturb(transformers.T5ForConditionalGeneration(cfg)), tmp), dtype="float32", device=DEVICE)


def bert(tmp: Path) -> inferflow.Model:
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=64)
    torch.manual_seed(0)
    m = inferflow.load(save(_perturb(transformers.BertModel(cfg)), tmp), dtype="float32", device=DEVICE)
    m.tokenizer = CharTokenizer()
    return m


def mix(n: int, seed: int = 0, max_prompt: int = 24, max_out: int = 10) -> tuple[list[list[int]], list[int]]:
    """``n`` random prompts of mixed lengths (1..max_prompt) and output lengths (1..max_out)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_prompt + 1, (n,), generator=g).tolist()
    outs = torch.randint(1, max_out + 1, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lens], outs
