"""A TP=2 model served through ``inferflow-service`` (rank 0: HTTP + scheduler, rank 1 follows) with the service
config's ``placement`` key answers an OpenAI chat request with the same greedy text as the model in one process:
launched by torchrun, spawning its own ranks, and by ``-m inferflow.parallel.serve``. ``llm_inference`` on a
query file with a placement too."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from service_helpers import chat_llama, free_port

ROOT = Path(__file__).resolve().parent.parent
MSG = [{"role": "user", "content": "hello world"}]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _want(folder: Path, ids: list[int]) -> str:
    import inferflow
    from inferflow.engine import Engine, EngineConfig, SamplingParams

    m = inferflow.load(folder, dtype="float32")
    res = Engine(m, EngineConfig(num_blocks=64, block_size=4)).generate(
        [ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(res[0].outputs[0].token_ids) == 6
    return res[0].outputs[0].text


@pytest.mark.parametrize("launch", ["torchrun", "spawn", "parallel.serve"])
def test_service_placement_tensor_parallel_chat(tmp_path, one_thread, launch):
    folder = chat_llama(tmp_path / "tiny")
    port = free_port()
    (tmp_path / "svc.json").write_text(json.dumps({"port": port, "log_level": "warning", "models": [
        {"name": "tiny", "source": str(folder), "dtype": "float32", "placement": {"tensor_parallel": 2},
         "engine": {"num_blocks": 64, "block_size": 4}}]}))
    # torchrun starts both ranks; without it the service spawns rank 1 itself; the older spelling names the
    # placement on the command line
    cmd = {"torchrun": TORCHRUN + ["-m", "inferflow.service", str(tmp_path / "svc.json")],
           "spawn": [sys.executable, "-m", "inferflow.service", str(tmp_path / "svc.json")],
           "parallel.serve": TORCHRUN + ["-m", "inferflow.parallel.serve", str(tmp_path / "svc.json"), "--placement",
                                         "0&1", "--threads", "1"]}[launch]
    proc = subprocess.Popen(cmd, env=ENV, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.25)
        body = {"model": "tiny", "messages": MSG, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["usage"]["completion_tokens"] == 6 and out["choices"][0]["finish_reason"] == "length"
        text = out["choices"][0]["message"]["content"]
        ids = httpx.post(url + "/tokenize", json={"model": "tiny", "messages": MSG}, timeout=30).json()["tokens"]
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # uvicorn stops, rank 0 releases the follower, both exit
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert _want(folder, ids) == text


def test_llm_inference_placement(tmp_path, one_thread):
    """``python -m inferflow.cli llm_inference q.yaml`` with ``placement: "0;1"`` (a 2-stage pipeline) spawns its
    second rank and prints (once) the text one process generates."""
    import yaml

    folder = chat_llama(tmp_path / "tiny")
    q = {"model": {"source": str(folder), "dtype": "float32", "chat": False, "placement": "0;1",
                   "engine": {"num_blocks": 64, "block_size": 4}},
         "sampling": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
         "queries": ["hello world", "the quick brown fox"]}
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(q))
    r = subprocess.run([sys.executable, "-m", "inferflow.cli", "llm_inference", str(tmp_path / "q.yaml")], env=ENV,
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("Inference results:") == 1, r.stdout  # rank 0 alone prints
    import inferflow

    tok = inferflow.load(folder, dtype="float32").tokenizer
    want = _want(folder, tok.encode("the quick brown fox"))
    assert f"===== Results of query 2: the quick brown fox\n{want}\n" in r.stdout, r.stdout
