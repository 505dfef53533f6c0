import json

import torch
import transformers

from parity import check_decoder, save


def test_gemma(tmp_path):
    # head_dim 24 != hidden / heads; tied head (Gemma's default); GQA
    cfg = transformers.GemmaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                   max_position_embeddings=64)
    ref = transformers.GemmaForCausalLM(cfg).eval()
    _randomize_norms(ref)
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "gemma"


def test_gemma_legacy_gelu_untied(tmp_path):
    # released configs say hidden_act "gelu" and mean the tanh approximation
    cfg = transformers.GemmaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                   max_position_embeddings=64, tie_word_embeddings=False)
    ref = transformers.GemmaForCausalLM(cfg).eval()
    _randomize_norms(ref)
    folder = save(ref, tmp_path)
    conf = json.loads((folder / "config.json").read_text())
    conf["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(conf))
    m = check_decoder(ref, folder, 96)
    assert m.params["mlp_act"] == "gelu_pytorch_tanh"


def _randomize_norms(model):
    """HF initialises (1 + w) norm weights to zero, which would hide a missing offset."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
