import json

import torch
import transformers

from parity import check_decoder, save


def _config(**kw):
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, max_position_embeddings=64, sliding_window=4,
                query_pre_attn_scalar=20, attn_logit_softcapping=0.05, final_logit_softcapping=0.3)
    return transformers.Gemma2Config(**{**base, **kw})


def _reference(cfg):
    ref = transformers.Gemma2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # zero-initialised (1 + w) norms would hide a missing offset
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return ref


def test_gemma2(tmp_path):
    # small caps so both soft-caps bend the values; window 4 < the test lengths on layers 0 and 2
    ref = _reference(_config())
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "gemma2"
    assert [layer.self_attn.window for layer in m.net.decoder.layers] == [4, None, 4]


def test_gemma2_without_layer_types_or_caps(tmp_path):
    ref = _reference(_config(attn_logit_softcapping=None, final_logit_softcapping=None, tie_word_embeddings=False))
    folder = save(ref, tmp_path)
    conf = json.loads((folder / "config.json").read_text())
    conf.pop("layer_types")
    (folder / "config.json").write_text(json.dumps(conf))
    m = check_decoder(ref, folder, 96)
    assert [layer.self_attn.window for layer in m.net.decoder.layers] == [4, None, 4]
