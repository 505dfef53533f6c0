import torch
import transformers

import inferflow

from parity import check_seq2seq, close, save

VOCAB = 96


def _t5(**kw) -> transformers.T5ForConditionalGeneration:
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                decoder_start_token_id=0, **kw)
    ref = transformers.T5ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # norms start at one: randomise them so they are exercised
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return ref.eval()


def test_t5_relu_tied(tmp_path):
    ref = _t5()
    m = check_seq2seq(ref, save(ref, tmp_path), VOCAB, start=ref.config.decoder_start_token_id)
    assert m.spec.name == "t5" and m.params["scale_decoder_outputs"]


def test_t5_v1_1_gated_gelu(tmp_path):
    ref = _t5(feed_forward_proj="gated-gelu", tie_word_embeddings=False, num_decoder_layers=3)
    m = check_seq2seq(ref, save(ref, tmp_path), VOCAB, start=ref.config.decoder_start_token_id)
    assert m.params["is_gated_act"] and not m.params["scale_decoder_outputs"]


def test_t5_generate_matches_reference(tmp_path):
    ref = _t5()
    m = inferflow.load(save(ref, tmp_path))
    enc = [5, 17, 33, 8, 41, 9]
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([enc]), max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, 1:].tolist()
    ours = m.generate_ids(enc, max_new_tokens=6, stop_ids=set())
    assert ours == theirs


def test_t5_equal_lengths(tmp_path):
    """Equal-length sequences take the batched (unsplit) attention path, relative bias included."""
    ref = _t5()
    m = inferflow.load(save(ref, tmp_path))
    enc = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]
    dec = [[0, 4, 5, 6], [0, 7, 8, 9]]
    ours = m.logits(dec, encoder_input_ids=enc)
    for b in range(2):
        with torch.no_grad():
            r = ref(input_ids=torch.tensor([enc[b]]), decoder_input_ids=torch.tensor([dec[b]])).logits[0]
        close(ours[b], r, f"equal lengths row {b}")
