"""Write a random-initialised HF model folder of a real model's shape, with a tokenizer covering its vocabulary,
for GPU benchmarks where the real weights cannot travel: throughput does not depend on the weight values when EOS
is ignored.

    python tools/random_hf_model.py qwen3-8b /tmp/qwen3-8b        # or smollm2-135m, llama-1b, tiny (--tiny)
    inferflow bench serving --model /tmp/qwen3-8b --device cuda --dtype bfloat16 ...

The folder: config.json + bf16 safetensors (``save_pretrained``; built on the GPU when there is one, so an 8B model
takes seconds to initialise), a ``tokenizers`` WordLevel tokenizer.json whose vocabulary is exactly the model's ids
(id i is the word ``<t{i}>``, whitespace pre-tokenizer: "<t5> <t17>" encodes to [5, 17] and any id decodes), and a
tokenizer_config.json. Built offline: nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu import QWEN3_8B, TINY  # noqa: E402  (one definition of the benchmark shapes)

# name -> (transformers config class, its arguments)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "smollm2-135m": ("LlamaConfig", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                         max_position_embeddings=8192, tie_word_embeddings=True,
                                         rope_theta=100000.0)),
    "llama-1b": ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                     max_position_embeddings=8192, tie_word_embeddings=True, rope_theta=500000.0)),
    "qwen3-8b": ("Qwen3Config", QWEN3_8B),
    "tiny": ("Qwen3Config", TINY),  # the Qwen3 layout at toy size (CPU smoke tests of the 8B pipeline)
}


def write_tokenizer(out: Path, vocab_size: int, model_max_length: int) -> None:
    """tokenizer.json (WordLevel, ``<t{i}>`` for every id) and tokenizer_config.json, for ``vocab_size`` ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # no decoder: decoding joins the words with spaces, so streamed deltas are " <t123>" (one per token)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False, "add_bos_token": False, "add_eos_token": False}, indent=1) + "\n")


def build(shape: str, out: str | Path, device: str | None = None, seed: int = 0) -> Path:
    """Write the folder; returns its path."""
    import torch
    import transformers

    cls_name, kw = SHAPES[shape]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    cfg = getattr(transformers, cls_name)(**kw)
    model_cls = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))
    old = torch.get_default_dtype()
    try:  # initialised directly in bf16 on the device: no float32 copy of 8B parameters
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(device):
            model = model_cls(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    model.save_pretrained(str(out))
    del model
    write_tokenizer(out, cfg.vocab_size, cfg.max_position_embeddings)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    ap.add_argument("out", help="folder to write")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape (same as shape 'tiny')")
    ap.add_argument("--device", help="where the weights are initialised (default: cuda when available)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    shape = "tiny" if args.tiny else args.shape
    if shape is None:
        ap.error("give a shape or --tiny")
    t0 = time.perf_counter()
    out = build(shape, args.out, args.device, args.seed)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors")) / 2 ** 30
    print(f"saved {shape} to {out} ({size:.2f} GiB of safetensors) in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
