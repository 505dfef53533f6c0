import transformers

from parity import check_decoder, save


def test_mistral_sliding_window(tmp_path):
    # window 4 < the test lengths (7, 11), so masking of old keys is exercised, also through the KV cache
    cfg = transformers.MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=4)
    ref = transformers.MistralForCausalLM(cfg).eval()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "mistral"
    assert all(layer.self_attn.window == 4 for layer in m.net.decoder.layers)


def test_mistral_no_window(tmp_path):
    cfg = transformers.MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                     sliding_window=None, tie_word_embeddings=True)
    ref = transformers.MistralForCausalLM(cfg).eval()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "mistral"
