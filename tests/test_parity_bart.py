import torch
import transformers

from parity import check_seq2seq, save

VOCAB = 96


def _bart(**kw) -> transformers.BartForConditionalGeneration:
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64, **kw)
    ref = transformers.BartForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # biases start at zero and norms at one: randomise them so they are exercised
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        ref.final_logits_bias.copy_(torch.randn(ref.final_logits_bias.shape, generator=g))
    return ref.eval()


def test_bart(tmp_path):
    ref = _bart()
    m = check_seq2seq(ref, save(ref, tmp_path), VOCAB, start=ref.config.decoder_start_token_id)
    assert m.spec.name == "bart"


def test_bart_scaled_embedding(tmp_path):
    ref = _bart(scale_embedding=True, activation_function="relu")
    m = check_seq2seq(ref, save(ref, tmp_path), VOCAB, start=ref.config.decoder_start_token_id)
    assert m.params["embed_scale"] > 1
