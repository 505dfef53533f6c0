"""Round trips: a tiny random model of each of qwen2, gpt2 and phi written to GGUF (F32, F16, Q8_0, Q4_0, as
llama.cpp's converter writes them) and to torch.save pickles (zip and legacy; fp32, fp16, bf16) loads with
the logits of the safetensors original. Lossless formats: bit-identical to the safetensors folder holding the
same values; quantized: identical to the safetensors folder holding the dequantized values, and within the
quantization error of the float32 original. (llama is covered in test_gguf.py and test_pickle.py.)"""
import copy

import pytest
import torch
import transformers

import inferflow
from gguf_files import Q, with_weights, write_gpt2, write_llama, write_phi2
from parity import save, sequences

VOCAB = 96


def _qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                                                n_positions=64))


def _phi():
    # intermediate = 4 * hidden: llama.cpp's converter writes feed_forward_length as 4 * n_embd
    return transformers.PhiForCausalLM(transformers.PhiConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, partial_rotary_factor=0.5))


FAMILIES = {
    "qwen2": (_qwen2, lambda m, p, q: write_llama(m, p, q, arch="qwen2", permute_qk=False)),
    "gpt2": (_gpt2, write_gpt2),
    "phi": (_phi, write_phi2),
}
SEQS = sequences(VOCAB)


def _logits(path, **kw) -> torch.Tensor:
    return inferflow.load(path, dtype="float32", **kw).logits(SEQS)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, float32 HF model, {dtype: safetensors folder of the model's weights in that dtype})."""
    name = request.param
    torch.manual_seed(0)
    ref = FAMILIES[name][0]().eval()
    folders = {}
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        folders[dt] = save(copy.deepcopy(ref).to(dt), tmp_path_factory.mktemp(f"{name}-{str(dt)[6:]}"))
    return name, ref, folders


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_gguf(family, tmp_path, qtype):
    name, ref, _ = family
    path = tmp_path / f"{name}.gguf"
    held = FAMILIES[name][1](ref, path, qtype)
    # no spec given: found by the file's general.architecture; bit-exact dequantization (the fast int4 path is bf16)
    m = inferflow.load(path, dtype="float32", quant_kernels="reference")
    assert m.spec.name == name and m.source.kind == "gguf"
    ours = m.logits(SEQS)
    # the safetensors folder holding exactly the values the file stores (fp16-rounded / dequantized)
    same = _logits(save(with_weights(ref, held), tmp_path / "held"))
    assert torch.equal(ours, same), (ours - same).abs().max().item()
    with torch.no_grad():
        orig = ref(torch.tensor([SEQS[1]])).logits[0]
    rel = ((ours[1] - orig).norm() / orig.norm()).item()
    assert rel <= {Q.F32: 1e-6, Q.F16: 1e-3, Q.Q8_0: 2e-2, Q.Q4_0: 0.2}[qtype], rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("how", ["zip", "legacy"])
def test_pickle(family, tmp_path, how, dtype):
    name, ref, folders = family
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text((folders[dtype] / "config.json").read_text())
    sd = {k: v.detach().to(dtype).clone() for k, v in ref.state_dict().items()}
    torch.save(sd, d / "pytorch_model.bin", _use_new_zipfile_serialization=how == "zip")
    m = inferflow.load(d, dtype="float32")
    assert m.spec.name == name and type(m.source).__name__ == "PickleSource"
    assert torch.equal(m.logits(SEQS), _logits(folders[dtype]))


def test_phi_gguf_fused_qkv(tmp_path):
    """Older phi-2 GGUFs hold Q|K|V in one attn_qkv tensor; rows split while still quantized."""
    torch.manual_seed(0)
    ref = _phi().eval()
    path = tmp_path / "phi-fused.gguf"
    held = write_phi2(ref, path, Q.Q8_0, fused=True)
    # the bit-exact kernels: the fast CPU set runs Q8_0 on bf16 int4 planes (inferflow/quant/cpu_kernels.py)
    m = inferflow.load(path, dtype="float32", quant_kernels="reference")
    assert m.net.decoder.layers[0].self_attn.q_proj.packed is not None
    assert torch.equal(m.logits(SEQS), _logits(save(with_weights(ref, held), tmp_path / "held")))
