"""inferflow bench: offline JSON fields, --vs hf ratios, --plot PNGs, --profile traces, serving metrics against a
live service, goodput arithmetic and the marked docs section. Tiny models; no timing is checked."""
import json
from pathlib import Path

import pytest
import torch
import transformers

from inferflow.bench import serving
from inferflow.bench.cli import bench_main, parse_args
from inferflow.bench.report import write_section
from service_helpers import LiveServer, chat_llama, tiny_llama_config


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_llama_config(96, max_position_embeddings=256)).save_pretrained(folder)
    return folder


def test_parse_args():
    a = parse_args([])
    assert (a.mode, a.batch, a.rounds, a.vs) == ("offline", [1, 8], 3, [])
    a = parse_args(["serving", "--vs", "hf", "--vs", "hf", "--batch", "1,8,64", "--slo-ttft-ms", "200"])
    assert a.mode == "serving" and a.vs == ["hf"] and a.batch == [1, 8, 64] and a.slo_ttft_ms == 200
    for bad in (["--batch", "0"], ["--batch", "x"], ["--new-tokens", "1"], ["--doc", "x.md"], ["--vs", "vllm"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_offline_vs_hf_json_plot_profile(tiny, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert bench_main(["--model", str(tiny), "--batch", "1,2", "--prompt-len", "5", "--new-tokens", "4", "--rounds",
                       "2", "--threads", "1", "--vs", "hf", "--json", str(out), "--plot", str(tmp_path / "png"),
                       "--profile", str(tmp_path / "trace"), "--profile-steps", "2"]) == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "offline" and r["command"].startswith("inferflow bench --model")
    assert r["machine"]["torch_threads"] == 1 and "torch" in r["versions"] and r["date"]
    assert r["config"]["batch"] == [1, 2] and r["config"]["prompt_tokens"] == [5, 5]
    rows = {(x["system"], x["batch"]): x for x in r["results"]}
    assert set(rows) == {("inferflow", 1), ("inferflow", 2), ("hf", 1), ("hf", 2)}
    for x in rows.values():
        assert x["prefill_tps"] > 0 and x["decode_tps"] > 0 and x["mem_mb"] > 0 and len(x["decode_samples"]) == 2
    assert [(x["peer"], x["batch"]) for x in r["ratios"]] == [("hf", 1), ("hf", 2)]
    for x in r["ratios"]:  # float32 on the same weights: greedy tokens agree with HF
        assert x["decode_tps"] > 0 and x["prefill_tps"] > 0 and x["same_greedy_tokens"] == f"{x['batch']}/{x['batch']}"
    assert sorted(p.name for p in (tmp_path / "png").glob("*.png")) == ["offline_decode_tps.png",
                                                                         "offline_prefill_tps.png"]
    trace = Path(r["profile_trace"])
    assert trace.is_file() and "traceEvents" in json.loads(trace.read_text())
    assert "ratios (ours / peer" in capsys.readouterr().out


def test_serving_against_live_server(tmp_path):
    from inferflow.service import config_from_dict, create_app

    cfg = config_from_dict({"models": [{"name": "tiny", "source": str(chat_llama(tmp_path / "m")),
                                        "engine": {"max_num_seqs": 4}}]})
    with LiveServer(create_app(cfg)) as srv:
        res = serving.run_serving(srv.url, [[5, 6, 7, 8]] * 5, 6, rate=200.0, max_concurrency=3,
                                  slo_ttft_ms=60_000, slo_tpot_ms=60_000)
        assert res["model"] == "tiny" and res["completed"] == 5 and res["failed"] == 0
        assert res["output_token_throughput"] > 0 and res["request_throughput"] > 0
        assert all(r["output_tokens"] == 6 for r in res["per_request"])  # ignore_eos: exactly max_tokens
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
            s = res[k]
            assert 0 < s["median"] <= s["p99"] and s["mean"] > 0
        assert res["ttft_ms"]["p99"] <= res["e2e_latency_ms"]["p99"]
        assert res["goodput"] == pytest.approx(res["request_throughput"])  # generous SLOs: every request is good
        out = tmp_path / "s.json"
        assert bench_main(["serving", "--url", srv.url, "--num-prompts", "3", "--prompt-len", "4", "--new-tokens",
                           "3", "--arrival", "fixed", "--request-rate", "100", "--json", str(out), "--plot",
                           str(tmp_path / "png")]) == 0
    r = json.loads(out.read_text())
    assert r["mode"] == "serving" and r["completed"] == 3 and r["tpot_ms"]["median"] > 0
    assert {p.name for p in (tmp_path / "png").glob("*.png")} == {"serving_latency_hist.png",
                                                                  "serving_latency_cdf.png"}


def test_goodput_and_arrivals():
    recs = []
    for ttft, lat, n in ((0.1, 1.0, 10), (0.5, 1.0, 10), (0.1, 5.0, 10)):
        r = serving.RequestRecord(4, ttft=ttft, latency=lat, output_tokens=n, itl=[0.1] * (n - 1))
        recs.append(r)
    recs.append(serving.RequestRecord(4, error="HTTP 500"))
    m = serving.aggregate(recs, 2.0, slo_ttft_ms=200, slo_tpot_ms=200)
    assert m["completed"] == 3 and m["failed"] == 1 and m["errors"] == ["HTTP 500"]
    assert m["goodput"] == 0.5  # only the first meets both SLOs (the second's TTFT, the third's TPOT miss)
    assert m["tpot_ms"]["median"] == pytest.approx(100.0)
    assert serving.arrival_gaps(3, float("inf"), "poisson") == [0.0] * 3
    assert serving.arrival_gaps(2, 4.0, "fixed") == [0.25, 0.25]
    gaps = serving.arrival_gaps(2000, 10.0, "poisson", seed=1)
    assert 0.09 < sum(gaps) / len(gaps) < 0.11


def test_engine_profiler_from_env(tiny, tmp_path, monkeypatch):
    import inferflow
    from inferflow.engine import Engine, EngineConfig, SamplingParams

    monkeypatch.setenv("INFERFLOW_PROFILE_DIR", str(tmp_path / "p"))
    monkeypatch.setenv("INFERFLOW_PROFILE_STEPS", "2")
    eng = Engine(inferflow.load(tiny), EngineConfig(max_num_seqs=2, max_model_len=64))
    eng.generate([[3, 4, 5]], SamplingParams(max_tokens=5, ignore_eos=True))
    traces = list((tmp_path / "p").glob("*.trace.json"))
    assert len(traces) == 1 and eng.profiler.done and json.loads(traces[0].read_text())["traceEvents"]


def test_write_section(tmp_path):
    doc = tmp_path / "b.md"
    doc.write_text("# T\n\nprose quoting `<!-- bench_cpu -->` stays\n<!-- other -->\nkeep\n<!-- /other -->\n")
    write_section(doc, "one", "bench_cpu")
    write_section(doc, "two", "bench_cpu")
    text = doc.read_text()
    assert "keep" in text and "one" not in text and "two" in text and "quoting `<!-- bench_cpu -->` stays" in text
    assert text.count("\n<!-- bench_cpu -->\n") == 1


def test_missing_llamacpp_or_gguf_is_a_clear_error(tiny, capsys):
    assert bench_main(["--model", str(tiny), "--vs", "llama.cpp", "--batch", "1", "--rounds", "1",
                       "--new-tokens", "2", "--prompt-len", "2"]) == 2
    assert "llama" in capsys.readouterr().err
