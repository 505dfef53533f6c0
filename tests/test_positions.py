"""Position components against the reference formulas in transformers."""
import torch
import transformers
from transformers import modeling_rope_utils as hf_rope
from transformers.models.m2m_100 import modeling_m2m_100 as m2m

from inferflow import registry


def _rope(scaling, dim=32, theta=10000.0, max_pos=64):
    return registry.create("rope", {"dim": dim, "theta": theta, "scaling": scaling, "max_position_embeddings": max_pos})


def _hf_inv_freq(scaling, dim=32, theta=10000.0, max_pos=64):
    cfg = transformers.LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, max_position_embeddings=max_pos,
                                   rope_parameters={"rope_theta": theta, **scaling})
    return hf_rope.ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")


def test_rope_scalings_match_transformers():
    cases = [
        {"rope_type": "linear", "factor": 4.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 16},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2},
    ]
    for s in cases:
        ours = _rope(s)
        inv, attn = _hf_inv_freq(s)
        torch.testing.assert_close(ours.inv_freq, inv.float(), rtol=1e-6, atol=0, msg=str(s))
        assert abs(ours.mscale - attn) < 1e-6, s


def test_sinusoidal_halves_matches_fairseq_table():
    dim, offset = 16, 2
    table = m2m.M2M100SinusoidalPositionalEmbedding.get_embedding(64, dim, padding_idx=1)
    comp = registry.create("sinusoidal_positions", {"dim": dim, "style": "halves", "offset": offset})
    pos = torch.arange(20)
    torch.testing.assert_close(comp(pos), table[pos + offset], rtol=1e-5, atol=1e-6)


def test_sinusoidal_interleaved_is_vaswani():
    dim = 8
    comp = registry.create("sinusoidal_positions", {"dim": dim, "style": "interleaved"})
    pos = torch.arange(5).float()
    out = comp(torch.arange(5))
    for i in range(dim // 2):
        torch.testing.assert_close(out[:, 2 * i], torch.sin(pos / 10000 ** (2 * i / dim)))
        torch.testing.assert_close(out[:, 2 * i + 1], torch.cos(pos / 10000 ** (2 * i / dim)))


def test_alibi_slopes_match_references():
    from inferflow.components.alibi import bloom_slopes, mpt_slopes
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    for n in (4, 6, 12):
        mask = torch.ones(1, 3)
        ref = build_alibi_tensor(mask, n, torch.float32).view(n, 3)[:, 1]  # slope * position 1
        torch.testing.assert_close(bloom_slopes(n), ref)
    assert torch.allclose(mpt_slopes(4), torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256]))
