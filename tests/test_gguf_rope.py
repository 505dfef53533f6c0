"""GGUF RoPE scaling takes effect: llama3 scaling as llama.cpp's converter writes it (the rope_freqs.weight
per-pair divisors, no metadata) and the {arch}.rope.scaling.* metadata (linear, yarn) match the HF reference
built with the same rope_parameters."""
import math

import gguf
import numpy as np
import pytest
import torch
import transformers

from gguf_files import Q, write_llama
from parity import check_decoder, close, sequences

VOCAB = 96
# head_dim 16, an original context of 32: one pair unscaled, one smoothed, six divided by 8 (and 11 positions
# are enough for the difference to show in the logits)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def tiny_llama(rope: dict | None) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, rope_parameters={"rope_theta": 10000.0, **(rope or {})})
    return transformers.LlamaForCausalLM(cfg).eval()


def llama3_rope_factors(rope: dict, theta: float, dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: llama3 scaling as frequency divisors."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wl, high_wl = old / lo, old / hi
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wl:
            out.append(1)
        elif wavelen > low_wl:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def _differs(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    """The scaling changes the logits beyond the parity tolerance (so matching the reference means something)."""
    ids = torch.tensor([sequences(VOCAB)[1]])
    with torch.no_grad():
        ra, rb = a(ids).logits[0], b(ids).logits[0]
    try:
        close(ra, rb, "")
    except AssertionError:
        return True
    return False


def test_llama3_rope_freqs_tensor(tmp_path):
    ref = tiny_llama(LLAMA3)
    assert _differs(ref, tiny_llama(None))
    factors = llama3_rope_factors(LLAMA3, 10000.0, 16)
    assert factors[0] == 1 and 1 < factors[1] < 8 and (factors[2:] == 8).all()
    path = tmp_path / "llama3.gguf"
    write_llama(ref, path, Q.F32, extra=lambda w: w.add_tensor("rope_freqs.weight", factors))
    m = check_decoder(ref, path, VOCAB)
    assert torch.equal(m.net.decoder.position.freq_factors, torch.from_numpy(factors))
    # bf16 weights: the divisors stay float32 like inv_freq
    import inferflow

    m16 = inferflow.load(path, dtype="bfloat16")
    assert m16.net.decoder.position.freq_factors.dtype == torch.float32


def test_no_rope_freqs_means_no_factors(tmp_path):
    ref = tiny_llama(None)
    path = tmp_path / "plain.gguf"
    write_llama(ref, path, Q.F32)
    m = check_decoder(ref, path, VOCAB)
    assert m.net.decoder.position.freq_factors is None


@pytest.mark.parametrize("rope,meta", [
    ({"rope_type": "linear", "factor": 4.0}, {"type": "linear", "factor": 4.0}),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
     {"type": "yarn", "factor": 4.0, "orig": 16}),
    ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16.0, "beta_slow": 2.0,
      "attention_factor": 1.25},
     {"type": "yarn", "factor": 8.0, "orig": 32, "beta_fast": 16.0, "beta_slow": 2.0, "attn": 1.25}),
], ids=["linear", "yarn", "yarn-betas"])
def test_rope_scaling_metadata(tmp_path, rope, meta):
    ref = tiny_llama(rope)
    assert _differs(ref, tiny_llama(None))

    def extra(w: gguf.GGUFWriter) -> None:  # what convert_hf_to_gguf.py writes for these rope_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType(meta["type"]))
        w.add_rope_scaling_factor(meta["factor"])
        if "orig" in meta:
            w.add_rope_scaling_orig_ctx_len(meta["orig"])
        if "beta_fast" in meta:
            w.add_rope_scaling_yarn_beta_fast(meta["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(meta["beta_slow"])
        if "attn" in meta:
            w.add_rope_scaling_yarn_attn_factor(meta["attn"])

    path = tmp_path / "scaled.gguf"
    write_llama(ref, path, Q.F32, extra=extra)
    m = check_decoder(ref, path, VOCAB)
    assert m.params["rope_scaling"]["type"] == meta["type"]


def test_unsupported_scaling_type_is_named(tmp_path):
    from inferflow.errors import InferflowError

    path = tmp_path / "longrope.gguf"
    write_llama(tiny_llama(None), path, Q.F32, extra=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE))
    import inferflow

    with pytest.raises((InferflowError, ValueError), match="longrope"):
        inferflow.load(path)
