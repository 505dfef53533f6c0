import pytest
import transformers

from parity import check_decoder, save


@pytest.mark.parametrize("kw", [
    {},                                                      # opt-125m style: pre-norm
    {"do_layer_norm_before": False, "word_embed_proj_dim": 32},  # opt-350m style: post-norm, project_in/out
], ids=["pre_norm", "post_norm_projected"])
def test_opt(tmp_path, kw):
    cfg = transformers.OPTConfig(vocab_size=96, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                 max_position_embeddings=64, **kw)
    ref = transformers.OPTForCausalLM(cfg).eval()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "opt"
