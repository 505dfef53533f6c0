import pytest
import transformers

from parity import check_decoder, save


@pytest.mark.parametrize("parallel", [True, False])
def test_gpt_neox(tmp_path, parallel):
    cfg = transformers.GPTNeoXConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5,
                                     use_parallel_residual=parallel, tie_word_embeddings=not parallel)
    ref = transformers.GPTNeoXForCausalLM(cfg).eval()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "gpt_neox"
