import pytest
import transformers

from parity import check_decoder, save


# 6 heads: a non-power-of-two head count exercises BLOOM's extra slope schedule
@pytest.mark.parametrize("heads,post_ln", [(4, False), (6, True)])
def test_bloom(tmp_path, heads, post_ln):
    cfg = transformers.BloomConfig(vocab_size=96, hidden_size=48, n_layer=2, n_head=heads,
                                   apply_residual_connection_post_layernorm=post_ln)
    ref = transformers.BloomForCausalLM(cfg).eval()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "bloom"
