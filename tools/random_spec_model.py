"""A model assembled from a spec with seeded random weights made directly on a device (no file): benchmarks of
large shapes whose real weights cannot travel (tools/bench_parallel.py). Every tensor has its own seed (from its
name), so every process (rank) builds bit-identical weights.

    from random_spec_model import SHAPES, build_model
    model = build_model(SHAPES["qwen3-8b"], torch.device("cuda"), torch.bfloat16, seed=0)   # spec qwen3
"""
from __future__ import annotations

import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "tiny": dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
                 rms_norm_eps=1e-6, tie_word_embeddings=False),
}


class _Source:
    """Stands in for a weight file: the config hyper-parameters are read from (no tensors)."""
    kind, path, config_name, arch = "hf", "<random>", "config.json", None

    def __init__(self, config: dict):
        self.config = dict(config)


def build_model(shape: dict, device: torch.device, dtype: torch.dtype, seed: int, spec: str = "qwen3"):
    """``spec`` assembled with ``shape`` (HF config keys) and random weights made on ``device``."""
    from inferflow.model.assembler import assemble
    from inferflow.model.model import Model
    from inferflow.spec.loader import load_spec
    from inferflow.spec.params import resolve_params

    src = _Source(shape)
    sp = load_spec(spec)
    params = resolve_params(sp, "hf", src.config)
    sp.params = params
    net = assemble(sp, params)
    for mod_name, module in net.named_modules():
        for pname, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            name = f"{mod_name}.{pname}"
            g = torch.Generator(device=device).manual_seed(seed * 1000003 + zlib.crc32(name.encode()))
            t = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32)
            # matrices: unit-variance outputs; vectors (norm weights, biases): around 1 / around 0
            t = t / p.shape[-1] ** 0.5 if p.dim() > 1 else (1 + 0.1 * t if "norm" in name else 0.02 * t)
            module._parameters[pname] = torch.nn.Parameter(t.to(dtype), requires_grad=False)
            del t
    net.eval().to(device)
    model = Model(sp, params, net, None, src, dtype, device)
    model.quantizer = None
    return model
