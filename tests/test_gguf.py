"""GGUF model files: tiny random HF models written as llama.cpp's converter writes them load with
inferflow.load(path.gguf) and match the reference; quantized weights stay packed; bad files are refused."""
import random
import struct

import pytest
import torch
import transformers

import inferflow
from gguf_files import Q, gstr, kv_str, kv_u32, raw_gguf, tensor_info, with_weights, write_gpt2, write_llama
from inferflow.errors import FormatError
from inferflow.loaders import open_file
from inferflow.loaders.gguf import GGUFSource
from parity import check_decoder, close, sequences

VOCAB = 96


def tiny_llama(**kw) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, **kw)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0])
def test_llama_gguf_matches_reference(tmp_path, qtype):
    ref = tiny_llama()
    path = tmp_path / "model.gguf"
    held = write_llama(ref, path, qtype)
    # the reference holds exactly the values the file stores (fp16-rounded or dequantized)
    m = check_decoder(with_weights(ref, held), path, VOCAB)
    assert m.spec.name == "llama" and m.source.kind == "gguf"
    if qtype == Q.F32:
        return
    # and against the float32 original: within the format's rounding / quantization error
    seq = sequences(VOCAB)[0]
    with torch.no_grad():
        orig = ref(torch.tensor([seq])).logits[0]
    ours = m.logits(seq)
    rel = ((ours - orig).norm() / orig.norm()).item()
    assert rel < {Q.F16: 1e-3, Q.Q8_0: 2e-2, Q.Q4_0: 0.2}[qtype], rel


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_gguf(tmp_path, family):
    torch.manual_seed(0)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    if family == "qwen2":
        ref = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw)).eval()
    else:
        ref = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=32, **kw)).eval()
    path = tmp_path / f"{family}.gguf"
    held = write_llama(ref, path, Q.Q8_0, arch=family, permute_qk=False)  # no q/k permutation for these
    m = check_decoder(with_weights(ref, held), path, VOCAB)
    assert m.spec.name == family


def test_gpt2_gguf(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    ref = transformers.GPT2LMHeadModel(cfg).eval()
    path = tmp_path / "gpt2.gguf"
    held = write_gpt2(ref, path, Q.Q4_0)
    m = check_decoder(with_weights(ref, held), path, VOCAB)
    assert m.spec.name == "gpt2"
    assert m.net.decoder.layers[0].attn.qkv_proj.packed is not None  # Conv1D weights stay packed too


def test_tied_head_falls_back_to_token_embd(tmp_path):
    ref = tiny_llama(tie_word_embeddings=True)
    path = tmp_path / "tied.gguf"
    held = write_llama(ref, path, Q.Q8_0)
    assert "output.weight" not in GGUFSource(path).names()
    m = check_decoder(with_weights(ref, held), path, VOCAB)
    # one packed table serves both the embedding and the head
    emb, head = m.net.decoder.embed.embed_tokens, m.net.head.lm_head
    assert emb.weight_blocks.data_ptr() == head.weight_blocks.data_ptr()


def test_q4_0_weights_stay_packed(tmp_path):
    ref = tiny_llama()
    path = tmp_path / "q4.gguf"
    write_llama(ref, path, Q.Q4_0)
    src = GGUFSource(path)
    quantized = {n for n in src.names() if src.tensor_type(n) == "Q4_0"}
    file_bytes = sum(src.tensors[n].nbytes for n in quantized)
    m = inferflow.load(path, quant_kernels="reference")  # raw blocks (fast repacks Q4_0: test_cpu_kernels.py)
    linears = [mod for mod in m.net.modules() if type(mod).__name__ == "Linear"]
    assert len(linears) == 2 * 7 + 1
    for lin in linears:
        assert lin.packed is not None and "weight" not in lin._parameters
        assert lin.weight_blocks.dtype == torch.uint8
    held = {}
    for t in list(m.net.buffers()) + list(m.net.parameters()):
        held[t.data_ptr()] = t.numel() * t.element_size()
    float_bytes = sum(p.numel() * p.element_size() for p in m.net.parameters())
    blocks = sum(t.numel() for name, t in m.net.named_buffers() if name.endswith("_blocks"))
    assert blocks == file_bytes  # every quantized tensor held as its raw blocks, nothing more
    assert float_bytes == 4 * 64 * (2 * 2 + 1)  # only the norms are float (fp32 would be ~8x the blocks)
    assert sum(held.values()) < 1.1 * file_bytes + float_bytes


def test_metadata_config_and_arrays(tmp_path):
    ref = tiny_llama()
    path = tmp_path / "meta.gguf"

    def extra(w):
        w.add_tokenizer_model("gpt2")
        w.add_token_list([f"t{i}" for i in range(5000)])

    write_llama(ref, path, Q.F16, extra=extra)
    src = open_file(path)
    assert isinstance(src, GGUFSource) and src.arch == "llama"
    assert src.config["llama.block_count"] == 2 and src.config["tokenizer.ggml.model"] == "gpt2"
    assert "tokenizer.ggml.tokens" not in src.config  # big tables stay out of config
    assert src.array_length("tokenizer.ggml.tokens") == 5000 and src.array("tokenizer.ggml.tokens")[4999] == "t4999"
    assert src.shape("blk.0.ffn_down.weight") == (64, 96)  # PyTorch order: [out, in]
    assert src.get("blk.0.ffn_down.weight").dtype == torch.float16


# ---- malformed files ----------------------------------------------------------------------------------

def good_parts():
    kvs = [kv_str("general.architecture", "llama"), kv_u32("general.alignment", 32)]
    infos = [tensor_info("a.weight", [32, 2], 0, 0), tensor_info("b.weight", [32], 8, 256)]
    data = bytes(256) + bytes(34)
    return kvs, infos, data


def refused(tmp_path, blob: bytes, *words: str) -> FormatError:
    p = tmp_path / "bad.gguf"
    p.write_bytes(blob)
    with pytest.raises(FormatError) as e:
        src = GGUFSource(p)
        for n in src.names():
            src.get(n)
    msg = str(e.value)
    assert str(p) in msg and all(w in msg for w in words), msg
    return e.value


def test_raw_builder_is_valid(tmp_path):
    p = tmp_path / "ok.gguf"
    p.write_bytes(raw_gguf(*good_parts()))
    src = GGUFSource(p)
    assert src.shape("a.weight") == (2, 32) and src.get("b.weight").shape == (32,)
    assert src.get("b.weight").dequantize().abs().sum() == 0


@pytest.mark.parametrize("case", ["magic", "version", "bigendian", "kv_count", "tensor_count", "string_len", "value_len", "dims",
                                  "n_dims", "type", "offset", "misaligned", "block", "alignment", "nested", "dup",
                                  "array_string"])
def test_malformed_header(tmp_path, case):
    kvs, infos, data = good_parts()
    if case == "magic":
        blob = b"GGUX" + raw_gguf(kvs, infos, data)[4:]
        p = tmp_path / "x.gguf"
        p.write_bytes(blob)
        with pytest.raises(FormatError):
            open_file(p)
        with pytest.raises(FormatError, match="not a GGUF file"):
            GGUFSource(p)
        return
    expect = {
        "version": ("unsupported GGUF version 7",), "bigendian": ("big-endian",),
        "kv_count": ("cannot", "fit"), "tensor_count": ("cannot", "fit"), "string_len": ("claims", "bytes"), "value_len": ("truncated",),
        "dims": ("outside the file",), "n_dims": ("5 dimensions",), "type": ("unknown ggml type id 99",),
        "offset": ("outside the file",), "misaligned": ("not a multiple of the alignment",),
        "block": ("not a multiple", "block size 32"), "alignment": ("power of two",), "nested": ("nested arrays",),
        "dup": ("duplicate tensor name",), "array_string": ("string in 'tokenizer.ggml.tokens'", "needs"),
    }[case]
    kw = {}
    if case == "version":
        kw["version"] = 7
    elif case == "bigendian":
        kw["version"] = 3 << 24
    elif case == "kv_count":
        kw["n_kv"] = 1 << 60
    elif case == "tensor_count":
        kw["n_tensors"] = 1 << 40
    elif case == "string_len":
        kvs[0] = struct.pack("<Q", 1 << 62) + b"general.architecture"
    elif case == "value_len":
        kvs[0] = gstr("general.architecture") + struct.pack("<IQ", 8, 1 << 62)
    elif case == "dims":
        infos[0] = tensor_info("a.weight", [32, 1 << 50], 0, 0)
    elif case == "n_dims":
        infos[0] = tensor_info("a.weight", [32, 1, 1, 1, 2], 0, 0)
    elif case == "type":
        infos[0] = tensor_info("a.weight", [32, 2], 99, 0)
    elif case == "offset":
        infos[1] = tensor_info("b.weight", [32], 8, 1 << 40)
    elif case == "misaligned":
        infos[1] = tensor_info("b.weight", [32], 8, 260)
    elif case == "block":
        infos[1] = tensor_info("b.weight", [33], 8, 256)
    elif case == "alignment":
        kvs[1] = kv_u32("general.alignment", 24)
    elif case == "nested":
        kvs.append(gstr("x") + struct.pack("<IIQ", 9, 9, 1))
    elif case == "dup":
        infos[1] = tensor_info("a.weight", [32], 8, 256)
    elif case == "array_string":  # a vocabulary whose second string claims more bytes than the file has
        kvs.append(gstr("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 3) + gstr("a") + struct.pack("<Q", 1 << 40)
                   + b"xy" + gstr("c"))
    refused(tmp_path, raw_gguf(kvs, infos, data, **kw), *expect)


def test_unsupported_type_names_type_and_tensor(tmp_path):
    kvs, infos, _ = good_parts()
    infos = [tensor_info("blk.0.attn_q.weight", [256], 16, 0)]  # IQ2_XXS: 66 bytes
    refused(tmp_path, raw_gguf(kvs, infos, bytes(66)), "IQ2_XXS", "blk.0.attn_q.weight")


def test_truncated_and_corrupted_files_never_crash(tmp_path):
    ref = tiny_llama()
    good = tmp_path / "good.gguf"
    write_llama(ref, good, Q.Q8_0, extra=lambda w: w.add_token_list([f"t{i}" for i in range(40)]))
    blob = good.read_bytes()
    rng = random.Random(0)
    p = tmp_path / "cut.gguf"
    for cut in sorted(rng.sample(range(len(blob)), 60)) + [0, 3, 10, 23]:
        p.write_bytes(blob[:cut])
        with pytest.raises(FormatError):
            GGUFSource(p)
    header_end = GGUFSource(good).tensors["token_embd.weight"].start
    for _ in range(300):  # random byte damage in the header: either a valid file or a FormatError
        b = bytearray(blob)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(header_end)] = rng.randrange(256)
        p.write_bytes(bytes(b))
        try:
            src = GGUFSource(p)
            for n in src.names():
                t = src.get(n)
                assert t.shape == src.shape(n)
        except FormatError:
            pass
    with pytest.raises(FormatError):
        inferflow.load(p.with_name("missing.gguf"))


def test_unmapped_tensors_refused_rope_freqs_ignored(tmp_path):
    import numpy as np

    from inferflow.errors import WeightError

    ref = tiny_llama()
    ok, bad = tmp_path / "ok.gguf", tmp_path / "bad.gguf"
    write_llama(ref, ok, Q.F32, extra=lambda w: w.add_tensor("rope_freqs.weight", np.ones(8, np.float32)))
    write_llama(ref, bad, Q.F32, extra=lambda w: w.add_tensor("blk.0.extra.weight", np.ones(8, np.float32)))
    ids = sequences(VOCAB)[1]
    with torch.no_grad():
        close(inferflow.load(ok).logits(ids), ref(torch.tensor([ids])).logits[0], "gguf with rope_freqs")
    with pytest.raises(WeightError, match="blk.0.extra.weight"):
        inferflow.load(bad)
