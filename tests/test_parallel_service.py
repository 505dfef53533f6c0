"""A TP=2 model served by ``torchrun -m inferflow.parallel.serve`` (rank 0: HTTP + scheduler, rank 1 follows)
answers an OpenAI chat request with the same greedy text as the model in one process."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from service_helpers import chat_llama

ROOT = Path(__file__).resolve().parent.parent
MSG = [{"role": "user", "content": "hello world"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_tensor_parallel_chat(tmp_path, one_thread):
    import inferflow
    from inferflow.engine import Engine, EngineConfig, SamplingParams

    folder = chat_llama(tmp_path / "tiny")
    port = _free_port()
    (tmp_path / "svc.json").write_text(json.dumps({"port": port, "log_level": "warning", "models": [
        {"name": "tiny", "source": str(folder), "dtype": "float32", "engine": {"num_blocks": 64, "block_size": 4}}]}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "inferflow.parallel.serve", str(tmp_path / "svc.json"), "--placement", "0&1", "--threads", "1"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
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
    m = inferflow.load(folder, dtype="float32")
    res = Engine(m, EngineConfig(num_blocks=64, block_size=4)).generate(
        [ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(res[0].outputs[0].token_ids) == 6 and res[0].outputs[0].text == text
