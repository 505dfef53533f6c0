import pytest
import transformers

from parity import check_decoder, save

VARIANTS = {
    # Falcon-40B/180B: grouped [q.., k, v] rows, ln_attn + ln_mlp, parallel attention + MLP
    "rope_new_arch": dict(new_decoder_architecture=True, num_kv_heads=2, num_attention_heads=8),
    # Falcon-7B: one shared k/v head, parallel attention + MLP with one LayerNorm
    "rope_mqa_parallel": dict(multi_query=True, parallel_attn=True, num_attention_heads=4),
    # Falcon-RW-1B: ALiBi, per-head [q, k, v] rows, sequential blocks, biases; 16 heads give slopes that
    # bfloat16 does not represent exactly
    "alibi": dict(alibi=True, multi_query=False, parallel_attn=False, bias=True, num_attention_heads=16),
    # the new architecture with a single LayerNorm shared by attention and MLP (Falcon2-11B)
    "rope_new_arch_one_ln": dict(new_decoder_architecture=True, num_kv_heads=2, num_attention_heads=4,
                                 num_ln_in_parallel_attn=1),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_falcon(tmp_path, variant):
    cfg = transformers.FalconConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, max_position_embeddings=64,
                                    **VARIANTS[variant])
    ref = transformers.FalconForCausalLM(cfg).eval()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "falcon"
