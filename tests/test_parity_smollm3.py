"""SmolLM3 through the shipped INI spec (model_specs/smollm3.ini): NoPE layers, tied head, sliding window."""
import transformers

from parity import check_decoder, save


def _cfg(**kw):
    return transformers.SmolLM3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      no_rope_layer_interval=2, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2, **kw)


def test_smollm3_nope_layers(tmp_path):
    ref = transformers.SmolLM3ForCausalLM(_cfg()).eval()
    assert ref.config.no_rope_layers == [1, 0]  # layer 1 attends without RoPE
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "smollm3" and m.spec.file.endswith(".ini")


def test_smollm3_sliding_window_untied(tmp_path):
    ref = transformers.SmolLM3ForCausalLM(_cfg(use_sliding_window=True, sliding_window=4,
                                               tie_word_embeddings=False)).eval()
    assert ref.config.layer_types == ["full_attention", "sliding_attention"]
    check_decoder(ref, save(ref, tmp_path), 96)
