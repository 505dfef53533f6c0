import transformers

from parity import check_decoder, save


def test_qwen3_qk_norm(tmp_path):
    # head_dim 24 != hidden / heads (16): Qwen3 sets head_dim explicitly
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                   max_position_embeddings=64)
    ref = transformers.Qwen3ForCausalLM(cfg).eval()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "qwen3"
    attn = m.net.decoder.layers[0].self_attn
    assert attn.q_norm is not None and attn.q_proj.bias is None


def test_qwen3_attention_bias_tied(tmp_path):
    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, head_dim=16, attention_bias=True,
                                   tie_word_embeddings=True, max_position_embeddings=64)
    ref = transformers.Qwen3ForCausalLM(cfg).eval()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.net.decoder.layers[0].self_attn.o_proj.bias is not None
