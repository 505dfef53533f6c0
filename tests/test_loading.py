"""HF-folder loading: sharded safetensors, memory mapping without copies, dtype selection."""
import json

import torch
import transformers

import inferflow
from parity import close, save, sequences


def _tiny(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    return ref, save(ref, tmp_path / "full")


def test_sharded_index(tmp_path):
    ref, folder = _tiny(tmp_path)
    sharded = tmp_path / "sharded"
    ref.save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    seq = sequences(64)[0]
    with torch.no_grad():
        r = ref(torch.tensor([seq])).logits[0]
    close(inferflow.load(sharded).logits(seq), r, "sharded")


def test_float32_weights_are_views_of_the_file(tmp_path):
    import ctypes

    _, folder = _tiny(tmp_path)
    m = inferflow.load(folder)
    mm = m.source.files["model.safetensors"]._map()
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    for name, w in m.net.named_parameters():
        # float32 -> float32 load: every weight is a view into the file's mapping, not a copy
        assert base <= w.data_ptr() < base + len(mm), name


def test_bfloat16_load(tmp_path):
    ref, folder = _tiny(tmp_path)
    m = inferflow.load(folder, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in m.net.parameters())
    seq = sequences(64)[0]
    with torch.no_grad():
        r = ref(torch.tensor([seq])).logits[0]
    out = m.logits(seq)
    assert out.dtype == torch.float32
    assert (out - r).abs().max() < 0.1 * r.abs().max()
