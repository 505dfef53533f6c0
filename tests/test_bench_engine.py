"""tools/bench_engine.py: argument parsing, the marked docs section, and a tiny end-to-end run (no timings checked)."""
import importlib.util
from pathlib import Path

import pytest
import torch
import transformers

from engine_models import VOCAB, one_thread  # noqa: F401 - fixture
from gguf_files import Q, write_llama

_spec = importlib.util.spec_from_file_location("bench_engine", Path(__file__).parent.parent / "tools" / "bench_engine.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_parse_args():
    a = bench.parse_args([])
    assert (a.concurrency, a.max_new_tokens, a.rounds, a.device, a.dtype) == ([1, 8, 32], 32, 2, "cpu", "float32")
    a = bench.parse_args(["--concurrency", "2,4", "--device", "cuda", "--rounds", "1"])
    assert a.concurrency == [2, 4] and a.dtype == "bfloat16"
    for bad in (["--concurrency", "x"], ["--concurrency", "0"], ["--max-new-tokens", "1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_write_section_replaces_only_the_marked_block(tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text("# Title\n\nintro\n")
    bench.write_section(doc, "first table")
    bench.write_section(doc, "second table")
    text = doc.read_text()
    assert text.startswith("# Title\n\nintro\n\n") and "first" not in text
    assert text.count(bench.BEGIN) == 1 and "second table" in text
    doc.write_text(text + "\n## Later section\n")
    bench.write_section(doc, "third")
    assert "third" in doc.read_text() and doc.read_text().endswith("## Later section\n")


def test_tiny_gguf_run_writes_the_table(tmp_path, capsys):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path / "tiny.gguf"
    write_llama(transformers.LlamaForCausalLM(cfg).eval(), path, Q.Q8_0)
    doc = tmp_path / "bench.md"
    assert bench.main(["--model", str(path), "--concurrency", "1,2", "--max-new-tokens", "3", "--rounds", "1",
                       "--write", str(doc), "--hf-dir", str(tmp_path / "hf")]) == 0
    text = doc.read_text()
    assert "--concurrency 1,2" in text and (tmp_path / "hf" / "config.json").is_file()
    rows = [line for line in text.splitlines() if line.startswith("| GGUF") or line.startswith("| HF-layout")]
    assert len(rows) == 4 and all(r.endswith("/1 |") or r.endswith("/2 |") for r in rows)
