"""Masked-LM scores through the engine's encoder batches against transformers' BertForMaskedLM."""
import pytest
import torch
import transformers

from engine_models import VOCAB, CharTokenizer, _perturb, one_thread  # noqa: F401 - fixture
import inferflow
from inferflow.engine import Engine, EngineConfig, FillMaskOutput
from inferflow.errors import InferflowError
from parity import close, save

MASK = "_"


@pytest.fixture(scope="module")
def mlm(tmp_path_factory):
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = _perturb(transformers.BertForMaskedLM(cfg))
    m = inferflow.load(save(ref, tmp_path_factory.mktemp("mlm")), dtype="float32")
    tok = CharTokenizer()
    tok.special_tokens = {"mask_token": MASK}
    m.tokenizer = tok
    return ref, m


def _ref_logits(ref, ids: list[int], positions: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0, positions].float()


def test_fill_mask_matches_bert_for_masked_lm(mlm):
    ref, m = mlm
    texts = ["the _ brown fox", "_", "jumps over the lazy _ and _", "a_b", "masked _ language model"] * 3
    eng = Engine(m, EngineConfig(max_num_batched_tokens=40, max_num_seqs=4))
    outs = eng.fill_mask(texts, top_k=5)
    assert len(outs) == 15 and all(isinstance(o, FillMaskOutput) and o.error is None for o in outs)
    assert eng.metrics()["fill_mask_requests"] == 15 and eng.metrics()["steps"] >= 4  # several encoder batches
    mask_id = m.tokenizer.encode(MASK)[0]
    for text, out in zip(texts, outs):
        ids = m.tokenizer.encode(text)
        assert out.prompt_token_ids == ids and out.positions == [j for j, t in enumerate(ids) if t == mask_id]
        r = _ref_logits(ref, ids, out.positions)
        want_p, want_i = torch.softmax(r, -1).topk(5, -1)
        for j, preds in enumerate(out.predictions):
            assert [p.rank for p in preds] == [1, 2, 3, 4, 5]
            assert [p.id for p in preds] == want_i[j].tolist()
            assert [p.token for p in preds] == [m.tokenizer.id_to_token(i) for i in want_i[j].tolist()]
            close(torch.tensor([p.score for p in preds]), want_p[j], f"{text!r} scores")
            close(torch.tensor([p.logit for p in preds]), r[j, want_i[j]], f"{text!r} logits")


def test_mixed_encoder_batch_logits_and_embeddings(mlm):
    """One encoder pass serves embedding and fill-mask inputs; full-vocab logits at the masks match HF."""
    ref, m = mlm
    eng = Engine(m)
    ids = [[5, 40, 7, 9, 12, 3], [8, 9, 10], [20, 21, 22, 23]]
    masks = [[1, 4], None, [0]]
    outs = eng.runner.encoder_batch(ids, masks)
    for s, mk, o in zip(ids, masks, outs):
        if mk is None:
            with torch.no_grad():  # the spec's pooling: mean, L2-normalised
                h = ref.bert(torch.tensor([s])).last_hidden_state[0]
            close(o, torch.nn.functional.normalize(h.mean(0), dim=-1), f"embedding {s}")
        else:
            assert o.shape == (len(mk), VOCAB)
            close(o, _ref_logits(ref, s, mk), f"mask logits {s}")
    # ids in, an explicit mask id, top_k beyond the vocabulary is clipped
    out = eng.fill_mask([5, 40, 7, 40], top_k=VOCAB + 10, mask_token_id=40)[0]
    assert out.positions == [1, 3] and len(out.predictions[0]) == VOCAB
    assert eng.embed([[8, 9, 10]]).shape == (1, 32)


def test_fill_mask_errors(mlm, tmp_path):
    _, m = mlm
    eng = Engine(m)
    with pytest.raises(InferflowError, match="no mask token"):
        eng.fill_mask("no masks here")
    with pytest.raises(InferflowError, match="top_k"):
        eng.fill_mask("a _", top_k=0)
    base = inferflow.load(save(transformers.BertModel(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64)), tmp_path), dtype="float32")
    with pytest.raises(InferflowError, match="MLM head"):
        Engine(base).fill_mask([[5, 6]], mask_token_id=5)
