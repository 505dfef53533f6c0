"""Token embeddings kept in host RAM (EngineConfig.host_embeddings / inferflow.load(host_embeddings=True)).

On this CPU-only machine host and device are the same memory, yet the same lookup path runs (look up where the
table is, move the rows to the ids' device): results must be identical and the tables must sit in host memory,
while a tied head keeps its own table on the model's device.
"""
import torch
import transformers

import engine_models
import inferflow
from engine_models import VOCAB, one_thread  # noqa: F401 - fixture
from gguf_files import Q, write_llama
from inferflow.engine import Engine, EngineConfig, SamplingParams
from inferflow.model.placement import HOST, place_embeddings, table_devices
from parity import save


def _llama_ref(tied: bool) -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_load_option_keeps_tables_on_host_with_identical_logits(tmp_path):
    folder = save(_llama_ref(tied=True), tmp_path)
    plain = inferflow.load(folder, dtype="float32")
    host = inferflow.load(folder, dtype="float32", host_embeddings=True)
    assert host.host_embeddings and table_devices(host.net) == {"decoder.embed.embed_tokens": HOST}
    # the tied head keeps its own table on the model's device (it reads all of it every step)
    assert host.net.head.lm_head.weight.device == host.device
    ids = [[5, 9, 11, 3, 40], [7, 8]]
    assert torch.equal(host.logits(ids), plain.logits(ids))
    assert host.generate_ids([5, 9, 11], max_new_tokens=6) == plain.generate_ids([5, 9, 11], max_new_tokens=6)
    assert place_embeddings(host, host=False) == ["decoder.embed.embed_tokens"] and not host.host_embeddings


def test_engine_config_places_packed_gguf_table(tmp_path):
    """A block-quantized (GGUF) table moves as its raw blocks; the engine's outputs do not change."""
    path = tmp_path / "m.gguf"
    write_llama(_llama_ref(tied=False), path, Q.Q8_0)
    prompts, outs = engine_models.mix(6, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
    want = [r.outputs[0].token_ids for r in Engine(inferflow.load(path, dtype="float32")).generate(prompts, params)]
    m = inferflow.load(path, dtype="float32")
    emb = m.net.decoder.embed.embed_tokens
    assert emb.packed is not None and not hasattr(emb, "weight")
    eng = Engine(m, EngineConfig(host_embeddings=True))
    assert m.host_embeddings and emb.weight_blocks.device == HOST
    assert [r.outputs[0].token_ids for r in eng.generate(prompts, params)] == want
    eng.cache.pool.assert_clean()


def test_encoder_tables_too(tmp_path):
    m = engine_models.bert(tmp_path)
    texts = ["hello world", "the quick brown fox"]
    ref = m.embed(texts)
    eng = Engine(m, EngineConfig(host_embeddings=True))
    assert table_devices(m.net) == {"encoder.embed.word_embeddings": HOST}
    assert torch.equal(eng.embed(texts), ref)
