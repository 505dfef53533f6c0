import pytest
import transformers

from parity import check_decoder, save


# 6 heads: MPT orders the slopes of non-power-of-two head counts differently from BLOOM
@pytest.mark.parametrize("heads,attn_config", [(4, {}), (6, {"clip_qkv": 0.05, "softmax_scale": 0.3})])
def test_mpt(tmp_path, heads, attn_config):
    cfg = transformers.MptConfig(vocab_size=96, d_model=48, n_layers=2, n_heads=heads, max_seq_len=64,
                                 attn_config=attn_config)
    ref = transformers.MptForCausalLM(cfg).eval()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "mpt"
