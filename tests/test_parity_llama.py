import transformers

from parity import check_decoder, save


def test_llama(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    m = check_decoder(ref, save(ref, tmp_path), 96)
    assert m.spec.name == "llama"


def test_llama_tied_llama3_rope(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                                   tie_word_embeddings=True, rope_theta=500000.0,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    ref = transformers.LlamaForCausalLM(cfg).eval()
    check_decoder(ref, save(ref, tmp_path), 96)


def test_padded_batch_with_attention_mask(tmp_path):
    """Left- and right-padded 2-D input with an attention mask equals the per-sequence reference."""
    import torch

    from parity import close, sequences

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    import inferflow

    m = inferflow.load(save(ref, tmp_path))
    a, b = sequences(96)
    width = len(b)
    for left in (True, False):
        ids = torch.zeros(2, width, dtype=torch.long)
        mask = torch.zeros(2, width, dtype=torch.long)
        for row, s in enumerate((a, b)):
            sl = slice(width - len(s), width) if left else slice(0, len(s))
            ids[row, sl], mask[row, sl] = torch.tensor(s), 1
        out = m.logits(ids, attention_mask=mask)
        assert out.shape == (2, width, 96)
        for row, s in enumerate((a, b)):
            with torch.no_grad():
                r = ref(torch.tensor([s])).logits[0]
            got = out[row][mask[row].bool()]
            close(got, r, f"{'left' if left else 'right'}-padded row {row}")
            assert out[row][~mask[row].bool()].abs().sum() == 0
