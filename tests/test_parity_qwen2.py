import json

import transformers

from parity import check_decoder, save


def test_qwen2_qkv_bias(tmp_path):
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    ref = transformers.Qwen2ForCausalLM(cfg).eval()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "qwen2"
    attn = m.net.decoder.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None


def test_qwen2_sliding_layers(tmp_path):
    # only layers >= max_window_layers slide; window 4 < the test lengths
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                   use_sliding_window=True, sliding_window=4, max_window_layers=1)
    ref = transformers.Qwen2ForCausalLM(cfg).eval()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert [layer.self_attn.window for layer in m.net.decoder.layers] == [None, 4]


def test_qwen2_hub_style_config_ignores_unused_window(tmp_path):
    # hub configs keep sliding_window set while use_sliding_window is false (and may lack layer_types)
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ref = transformers.Qwen2ForCausalLM(cfg).eval()
    folder = save(ref, tmp_path)
    conf = json.loads((folder / "config.json").read_text())
    conf.pop("layer_types", None)
    conf.update(sliding_window=4, use_sliding_window=False, max_window_layers=0)
    (folder / "config.json").write_text(json.dumps(conf))
    m = check_decoder(ref, folder, 96)
    assert [layer.self_attn.window for layer in m.net.decoder.layers] == [None, None]
