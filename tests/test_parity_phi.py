import json

import transformers

from parity import check_decoder, save


def test_phi(tmp_path):
    # partial rotary (0.4 of head_dim 16 -> 6 dims), biases everywhere, lm_head bias, GQA
    cfg = transformers.PhiConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 partial_rotary_factor=0.4)
    ref = transformers.PhiForCausalLM(cfg).eval()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "phi"
    assert m.net.decoder.position.dim == 6


def test_phi_qk_layernorm_legacy_config(tmp_path):
    # Phi-2 hub configs keep partial_rotary_factor and rope_theta at top level
    cfg = transformers.PhiConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=64, partial_rotary_factor=0.5,
                                 qk_layernorm=True)
    ref = transformers.PhiForCausalLM(cfg).eval()
    folder = save(ref, tmp_path)
    conf = json.loads((folder / "config.json").read_text())
    rope = conf.pop("rope_parameters")
    conf.update(partial_rotary_factor=rope["partial_rotary_factor"], rope_theta=rope["rope_theta"])
    (folder / "config.json").write_text(json.dumps(conf))
    m = check_decoder(ref, folder, 96)
    assert m.net.decoder.position.dim == 8 and m.net.decoder.layers[0].self_attn.q_norm is not None
