"""Inferflow model_spec.json files load unchanged: translated to a shipped spec, they give the logits of loading
the same weights directly. The specs below follow Inferflow's own (data/models/*/model_spec.json)."""
import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

import inferflow
from gguf_files import Q, write_llama
from inferflow.errors import SpecError
from parity import save, sequences

VOCAB = 96
SEQS = sequences(VOCAB)
HEADER = "#" * 80 + "\n# Please refer to docs/model_setup.md for instructions about editing model_spec.json.\n" + "#" * 80 + "\n\n"


def write_spec(folder, network_structure: dict, **top) -> str:
    doc = {"config_file": "config.json", "model_files": ["model.safetensors"], "model_file_format": "safetensors",
           "tokenizer_files": [], "tokenization_algorithm": "bpe", "generation_config": "", **top,
           "network_structure": network_structure}
    path = folder / top.pop("spec_name", "model_spec.json")
    path.write_text(HEADER + json.dumps(doc, indent=4))
    return path


LLAMA_NS = {"type": "transformer.llama", "normalization_function": "rms", "activation_function": "silu",
            "position_embedding": "rope", "qk_column_order": 2, "qkv_format": 1, "tensor_name_prefix": "model.",
            "tensor_name_mapping": {}}


def _llama(tmp_path, name="llama"):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    return ref, save(ref, tmp_path / name)


def _same(a, b):
    la, lb = inferflow.load(a, dtype="float32"), inferflow.load(b, dtype="float32")
    assert torch.equal(la.logits(SEQS), lb.logits(SEQS))
    return la


def test_llama_spec_with_builtin_names(tmp_path):
    _, folder = _llama(tmp_path)
    spec = write_spec(folder, LLAMA_NS)
    m = _same(spec, folder)
    assert m.spec.name == "llama" and "model_spec.json" in m.spec.file
    # the same file as an explicit spec for the folder (how an Inferflow service config names it)
    m2 = inferflow.load(folder, spec=spec, dtype="float32")
    assert torch.equal(m2.logits(SEQS), m.logits(SEQS))


def test_llama_meta_names_through_tensor_name_mapping(tmp_path):
    """A checkpoint with Meta's tensor names; the Inferflow spec maps them to standard names."""
    ref, hf = _llama(tmp_path, "hf")
    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / "config.json").write_text((hf / "config.json").read_text())
    rename = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output",
              "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk", "self_attn.v_proj": "attention.wv",
              "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
              "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
              "post_attention_layernorm": "ffn_norm", "model.layers": "layers"}
    sd = {}
    for k, v in ref.state_dict().items():
        for a, b in rename.items():
            k = k.replace(a, b)
        sd[k] = v.contiguous()
    assert "layers.1.attention.wq.weight" in sd and "tok_embeddings.weight" in sd
    save_file(sd, meta / "consolidated.safetensors")
    mapping = {"tok_embeddings.weight": "dec.token_embeddings.weight", "norm.weight": "dec.output_norm.weight",
               "output.weight": "output.weight"}
    for src, std in (("attention.wq", "self_attn.wq"), ("attention.wk", "self_attn.wk"), ("attention.wv", "self_attn.wv"),
                     ("attention.wo", "self_attn.wo"), ("feed_forward.w1", "feed_forward.w1"),
                     ("feed_forward.w2", "feed_forward.w2"), ("feed_forward.w3", "feed_forward.w3"),
                     ("attention_norm", "self_attn.pre_norm"), ("ffn_norm", "feed_forward.pre_norm")):
        mapping[f"layers.{{i}}.{src}.weight"] = f"dec.{{i}}.{std}.weight"
    spec = write_spec(meta, {**LLAMA_NS, "type": "transformer.decoder_only", "tensor_name_prefix": "",
                             "tensor_name_mapping": mapping, "rope_theta": 10000.0},
                      model_files=["consolidated.safetensors"])
    _same(spec, hf)


def test_qwen_spec_picks_qwen2_by_config(tmp_path):
    """Qwen1.5's Inferflow spec: llama flags; config.json's model_type picks qwen2 (q/k/v biases) among them."""
    torch.manual_seed(0)
    ref = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)).eval()
    folder = save(ref, tmp_path / "qwen")
    spec = write_spec(folder, {"type": "transformer.decoder_only", "normalization_function": "rms",
                               "activation_function": "silu", "position_embedding": "rope", "qk_column_order": 2,
                               "tensor_name_prefix": "model.",
                               "tensor_name_mapping": {"norm.weight": "dec.output_norm.weight"}},
                      token_bytes_mapping=1)
    assert _same(spec, folder).spec.name == "qwen2"


BERT_MAPPING = {
    "embeddings.word_embeddings.weight": "enc.token_embeddings.weight",
    "embeddings.position_embeddings.weight": "enc.pos_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "enc.token_type_embeddings.weight",
    "embeddings.LayerNorm.gamma": "enc.input_norm.weight",
    "embeddings.LayerNorm.beta": "enc.input_norm.bias",
    **{f"encoder.layer.{{i}}.attention.self.{a}.{s}": f"enc.{{i}}.self_attn.{b}.{s}"
       for a, b in (("query", "wq"), ("key", "wk"), ("value", "wv")) for s in ("weight", "bias")},
    "encoder.layer.{i}.attention.output.dense.weight": "enc.{i}.self_attn.wo.weight",
    "encoder.layer.{i}.attention.output.dense.bias": "enc.{i}.self_attn.wo.bias",
    "encoder.layer.{i}.attention.output.LayerNorm.gamma": "enc.{i}.self_attn.post_norm.weight",
    "encoder.layer.{i}.attention.output.LayerNorm.beta": "enc.{i}.self_attn.post_norm.bias",
    "encoder.layer.{i}.intermediate.dense.weight": "enc.{i}.feed_forward.w1.weight",
    "encoder.layer.{i}.intermediate.dense.bias": "enc.{i}.feed_forward.w1.bias",
    "encoder.layer.{i}.output.dense.weight": "enc.{i}.feed_forward.w2.weight",
    "encoder.layer.{i}.output.dense.bias": "enc.{i}.feed_forward.w2.bias",
    "encoder.layer.{i}.output.LayerNorm.gamma": "enc.{i}.feed_forward.post_norm.weight",
    "encoder.layer.{i}.output.LayerNorm.beta": "enc.{i}.feed_forward.post_norm.bias",
    "cls.predictions.transform.dense.weight": "output_transform.weight",
    "cls.predictions.transform.dense.bias": "output_transform.bias",
    "cls.predictions.transform.LayerNorm.gamma": "output_transform.post_norm.weight",
    "cls.predictions.transform.LayerNorm.beta": "output_transform.post_norm.bias",
    "cls.predictions.bias": "enc.output.bias",
}


@pytest.mark.parametrize("legacy_names", [False, True])
def test_bert_spec(tmp_path, legacy_names):
    """bert_base_multilingual_cased's spec (gamma/beta LayerNorm names, "bert." prefix) on a masked-LM BERT;
    ``legacy_names``: the checkpoint itself uses gamma/beta, as that model's file on the hub does."""
    torch.manual_seed(0)
    ref = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64)).eval()
    folder = save(ref, tmp_path / "bert")
    if legacy_names:
        from safetensors.torch import load_file

        sd = load_file(folder / "model.safetensors")
        sd = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in sd.items()}
        assert "bert.embeddings.LayerNorm.gamma" in sd
        save_file(sd, folder / "model.safetensors")
    spec = write_spec(folder, {"type": "transformer.encoder_only", "normalization_function": "std",
                               "activation_function": "gelu", "position_embedding": "empty", "qk_column_order": 2,
                               "qkv_format": 1, "normalize_lm_head": False, "tensor_name_prefix": "bert.",
                               "tensor_name_mapping": BERT_MAPPING}, tokenization_algorithm="fmm")
    m = inferflow.load(spec, dtype="float32")
    assert m.spec.name == "bert"
    with torch.no_grad():
        for b, s in enumerate(SEQS):
            r = ref(torch.tensor([s])).logits[0]
            assert (m.logits(SEQS)[b, :len(s)] - r).abs().max() <= 1e-4 * r.abs().max() + 1e-5
    if not legacy_names:
        _same(spec, folder)


def test_phi_spec(tmp_path):
    """phi_2's spec: parallel attention, kq_scale (a numeric guard), its own tensor_name_mapping."""
    torch.manual_seed(0)
    ref = transformers.PhiForCausalLM(transformers.PhiConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, partial_rotary_factor=0.5)).eval()
    folder = save(ref, tmp_path / "phi")
    mapping = {"embed_tokens.weight": "dec.token_embeddings.weight", "final_layernorm.weight": "dec.output_norm.weight",
               "final_layernorm.bias": "dec.output_norm.bias"}
    for src, std in (("input_layernorm", "self_attn.pre_norm"), ("self_attn.q_proj", "self_attn.wq"),
                     ("self_attn.k_proj", "self_attn.wk"), ("self_attn.v_proj", "self_attn.wv"),
                     ("self_attn.dense", "self_attn.wo"), ("mlp.fc1", "feed_forward.w1"), ("mlp.fc2", "feed_forward.w2")):
        for s in ("weight", "bias"):
            mapping[f"layers.{{i}}.{src}.{s}"] = f"dec.{{i}}.{std}.{s}"
    spec = write_spec(folder, {"type": "transformer.decoder_only", "normalization_function": "std",
                               "activation_function": "gelu", "position_embedding": "rope", "qk_column_order": 2,
                               "kq_scale": 10, "is_parallel_attn": True, "tensor_name_prefix": "model.",
                               "tensor_name_mapping": mapping})
    assert _same(spec, folder).spec.name == "phi"


def test_gguf_spec(tmp_path):
    """llama2_7b_chat.gguf's spec: "blk." prefix and GGUF names; q/k rows are still un-permuted."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    path = tmp_path / "llama-2-tiny.Q8_0.gguf"
    write_llama(transformers.LlamaForCausalLM(cfg).eval(), path, Q.Q8_0)
    mapping = {f"{{i}}.{a}.weight": f"dec.{{i}}.{b}.weight" for a, b in (
        ("attn_norm", "self_attn.pre_norm"), ("attn_q", "self_attn.wq"), ("attn_k", "self_attn.wk"),
        ("attn_v", "self_attn.wv"), ("attn_output", "self_attn.wo"), ("ffn_norm", "feed_forward.pre_norm"),
        ("ffn_gate", "feed_forward.w1"), ("ffn_down", "feed_forward.w2"), ("ffn_up", "feed_forward.w3"))}
    spec = write_spec(tmp_path, {**LLAMA_NS, "qk_column_order": 1, "qkv_format": 0, "tensor_name_prefix": "blk.",
                                 "tensor_name_mapping": mapping},
                      config_file="", model_files=[path.name], model_file_format="gguf", tokenizer_file="")
    _same(spec, path)


@pytest.mark.parametrize("change,key,words", [
    ({"network_structure": {**LLAMA_NS, "normalize_lm_head": True}}, "network_structure.normalize_lm_head",
     ["not supported"]),
    ({"network_structure": {**LLAMA_NS, "tensor_name_mapping": {"x.weight": "dec.{i}.moe.gate.weight"}}},
     "network_structure.tensor_name_mapping['x.weight']", ["dec.{i}.moe.gate.weight", "no counterpart"]),
    ({"network_structure": {**LLAMA_NS, "position_embedding": "sinusoidal2"}}, "network_structure",
     ["no shipped spec"]),
    ({"network_structure": {**LLAMA_NS, "qk_column_order": 0}}, "network_structure.qk_column_order", ["rotate-half"]),
    ({"network_structure": {**LLAMA_NS, "hidden_sise": 3}}, "network_structure.hidden_sise", ["not an Inferflow"]),
    ({"network_structure": {**LLAMA_NS, "type": "transformer.mamba"}}, "network_structure.type", ["not an Inferflow"]),
    ({"model_file_format": "ggml"}, "model_file_format", ["not supported"]),
    ({"model_files": ["missing.safetensors"]}, "model_files[0]", ["not found"]),
    ({"config_file": "params.json"}, "config_file", ["config.json"]),
])
def test_refusals_name_file_and_key(tmp_path, change, key, words):
    _, folder = _llama(tmp_path)
    ns = change.pop("network_structure", LLAMA_NS)
    spec = write_spec(folder, ns, **change)
    with pytest.raises(SpecError) as e:
        inferflow.load(spec)
    msg = str(e.value)
    assert msg.startswith(f"{spec}") and e.value.key == key and all(w in msg for w in words), msg
