import torch
import torch.nn.functional as F
import transformers

from parity import check_encoder, close, save, sequences

VOCAB = 96


def _config(**kw) -> transformers.BertConfig:
    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=64, **kw)


def _perturb(model: torch.nn.Module) -> torch.nn.Module:
    """HF initialises biases to zero and norms to one; randomise them so every tensor is exercised."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


class _CharTokenizer:
    """A stand-in tokenizer for m.embed(): one id per character."""

    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % (VOCAB - 3) for c in text]


def test_bert_base_hidden_states_and_pooling(tmp_path):
    ref = _perturb(transformers.BertModel(_config()))
    m = check_encoder(ref, save(ref, tmp_path), VOCAB, logits=False)
    assert m.spec.name == "bert" and m.net.head is None
    # sentence embeddings: masked mean over the ragged batch, then L2-normalised
    m.tokenizer = _CharTokenizer()
    texts = ["hello world", "a much longer sentence here"]
    ours = m.embed(texts)
    for b, t in enumerate(texts):
        with torch.no_grad():
            h = ref(torch.tensor([m.tokenizer.encode(t)])).last_hidden_state[0]
        close(ours[b], F.normalize(h.mean(0), dim=-1), f"embed {b}")


def test_bert_token_types(tmp_path):
    ref = _perturb(transformers.BertModel(_config(type_vocab_size=2)))
    import inferflow

    m = inferflow.load(save(ref, tmp_path))
    seqs = sequences(VOCAB)
    types = [[int(j >= len(s) // 2) for j in range(len(s))] for s in seqs]
    ours = m.hidden_states(seqs, token_type_ids=types)
    for b, (s, t) in enumerate(zip(seqs, types)):
        with torch.no_grad():
            r = ref(torch.tensor([s]), token_type_ids=torch.tensor([t])).last_hidden_state[0]
        close(ours[b, :len(s)], r, f"token types row {b}")


def test_bert_masked_lm(tmp_path):
    ref = _perturb(transformers.BertForMaskedLM(_config(hidden_act="gelu_new")))
    m = check_encoder(ref, save(ref, tmp_path), VOCAB, logits=True)
    assert m.net.head is not None
