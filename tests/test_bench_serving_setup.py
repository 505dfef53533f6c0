"""The GPU serving benchmark's pieces on a toy shape: tools/random_hf_model.py (weights + a tokenizer covering every
id), `inferflow bench serving` on its folder (several rates, engine options, client process, JSON, docs section
and its re-rendering from JSON), and tools/bench_gpu.py's docs section. No timing is checked."""
import json
import math
import sys
from pathlib import Path

import pytest

from inferflow.bench.cli import bench_main, parse_args

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

import random_hf_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return random_hf_model.build("tiny", tmp_path_factory.mktemp("rand") / "m", device="cpu")


def test_random_folder_has_a_tokenizer_for_every_id(folder):
    import inferflow

    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["dtype"] == "bfloat16" and list(folder.glob("*.safetensors"))
    m = inferflow.load(str(folder))
    tok, vocab = m.tokenizer, cfg["vocab_size"]
    assert tok.vocab_size == vocab
    assert tok.encode("<t5> <t17>") == [5, 17]
    assert tok.decode([5, 17, vocab - 1]) == f"<t5> <t17> <t{vocab - 1}>"


def test_parse_serving_options():
    a = parse_args(["serving", "--request-rate", "inf,8", "--max-num-seqs", "256", "--max-num-batched-tokens",
                    "8192", "--gpu-memory-utilization", "0.85", "--doc", "x.md"])
    assert a.request_rate[1] == 8.0 and math.isinf(a.request_rate[0]) and a.max_num_seqs == 256
    from inferflow.bench.run_serving import engine_overrides

    assert engine_overrides(a) == {"max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.85}
    a = parse_args(["serving", "--kv-cache-dtype", "fp8"])
    assert engine_overrides(a) == {"kv_cache_dtype": "fp8"}  # the served engine's K/V, as offline runs take it
    for bad in (["serving", "--request-rate", "0"], ["serving", "--request-rate", "x"],
                ["serving", "--from-json", "r.json"], ["--from-json", "r.json", "--doc", "x.md"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_shared_prefix_prompts():
    """--prefix-len: prompt i starts with prefix i % --num-prefixes (prefix-cache hits, vLLM's prefix repetition);
    the rest of each prompt and the prefixes of another seed (the next run, its warm-up) differ."""
    from inferflow.bench.run_serving import _prompts
    from inferflow.errors import InferflowError

    a = parse_args(["serving", "--prompt-len", "40", "--prefix-len", "32", "--num-prefixes", "2"])
    p, other = _prompts(a, 1000, None, 0, 6), _prompts(a, 1000, None, 2, 6)
    assert all(len(x) == 40 for x in p) and p[0][:32] == p[2][:32] == p[4][:32] and p[1][:32] == p[5][:32]
    assert p[0][:32] != p[1][:32] and len({tuple(x[32:]) for x in p}) == 6 and other[0][:32] != p[0][:32]
    for bad in ("40", "-3"):
        with pytest.raises(InferflowError, match="--prefix-len"):
            _prompts(parse_args(["serving", "--prompt-len", "40", "--prefix-len", bad]), 1000, None, 0, 2)


def test_serving_on_the_random_folder(folder, tmp_path, capsys):
    out, doc = tmp_path / "s.json", tmp_path / "doc.md"
    doc.write_text("# Benchmarks\n\nprose\n\n<!-- bench_serving -->\n<!-- /bench_serving -->\n\nmore prose\n")
    assert bench_main(["serving", "--model", str(folder), "--num-prompts", "4", "--prompt-len", "8", "--new-tokens",
                       "3", "--batch", "4", "--threads", "1", "--request-rate", "inf,200", "--arrival", "fixed",
                       "--max-num-batched-tokens", "16", "--kv-cache-memory", "0.01", "--warmup-requests", "2",
                       "--json", str(out), "--doc", str(doc)]) == 0
    r = json.loads(out.read_text())
    assert r["completed"] == 4 and r["config"]["client"] == "process" and len(r["runs"]) == 2
    assert [x["completed"] for x in r["runs"]] == [4, 4] and r["runs"][1]["rate"] == 200.0
    assert all(x["output_tokens"] == 3 for run in r["runs"] for x in run["per_request"])
    assert r["runs"][0]["ttft_ms"]["median"] > 0 and r["runs"][1]["tpot_ms"]["median"] > 0
    eng = r["engine"]
    assert eng["max_num_batched_tokens"] == 16 and eng["max_num_seqs"] == 8 and eng["kv_blocks"] > 0
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nprose\n") and text.endswith("<!-- /bench_serving -->\n\nmore prose\n")
    assert "| all at once | 4/4 |" in text and "| 200 req/s, fixed | 4/4 |" in text and "--request-rate inf,200" in text
    assert "all at once: 4/4 requests" in capsys.readouterr().out
    # the same section re-rendered from the JSON alone (how results from the GPU machine reach the docs)
    doc2 = tmp_path / "doc2.md"
    doc2.write_text("x\n")
    assert bench_main(["serving", "--from-json", str(out), "--doc", str(doc2)]) == 0
    assert doc2.read_text().split("<!-- bench_serving -->")[1] == text.split("<!-- bench_serving -->")[1].split(
        "\n\nmore prose")[0] + "\n"


def test_bench_gpu_doc_section(tmp_path):
    import bench_gpu
    from inferflow.bench.report import header

    res = {"shape": bench_gpu.TINY, "device": "NVIDIA H200", "torch": "2.11", "transformers": "5.17",
           "date": "2026-11-29", "args": {"batches": "1,64"}, "header": header(["--out", "o"], "python tools/bench_gpu.py"),
           "logits": {"max_rel_diff": 0.056, "top1_agree": 4, "of": 4}, "kernel_max_abs_err": {"plain": 0.0078},
           "decode": {"inferflow b1": {"tps": 190.0}, "hf b1": {"tps": 150.0}},
           "prefill": {"inferflow": {"tps": 38000.0}, "hf": {"tps": 31000.0}, "hf_static": {"tps": 25000.0}},
           "q4_decode": {"q4 b1": {"tps": 345.0}, "bf16 b1": {"tps": 230.0}, "q4 triton b1": {"tps": 310.5}}}
    js = tmp_path / "bench_gpu.json"
    js.write_text(json.dumps(res))
    doc = tmp_path / "b.md"
    doc.write_text("intro\n\n<!-- bench_gpu -->\nold\n<!-- /bench_gpu -->\n")
    assert bench_gpu.main(["--from-json", str(js), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n\n<!-- bench_gpu -->\n### GPU fast path") and "old" not in text
    assert "python tools/bench_gpu.py --out o" in text and "| decode tok/s, batch 1 | 190.0 | 150.0 | 1.27 |" in text
    assert "top-1 4/4" in text and "plain 0.0078" in text and "Machine:" in text
    assert "vs HF's static-cache path (StaticCache, eager prompt forward) | 38000 | 25000 | 1.52 |" in text
    assert "vs HF eager without a cache (HF's fastest) | 38000 | 31000 | 1.23 |" in text
    assert "| q4 decode tok/s, batch 1 (bf16 in the same phase: 230.0) | 345.0 | | 1.50 x bf16 |" in text
    assert "| q4 decode tok/s, batch 1, Triton kernels only (`--q4-ab`) | 310.5 | | 1.35 x bf16 |" in text
