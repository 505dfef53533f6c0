"""A tensor-parallel rank crash behind ``inferflow-service``: a TP=2 service (rank 0 spawns rank 1) whose follower is
killed fails the request in flight with a clear 500, then answers ``/health`` with 503 naming the reason and refuses
new requests with 503 (no later step could line up its collectives), instead of failing every request while
claiming to be healthy."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from service_helpers import chat_llama, free_port

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        text = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in text.split()]


def test_follower_rank_crash_is_reported(tmp_path, one_thread):
    folder = chat_llama(tmp_path / "tiny")
    port = free_port()
    (tmp_path / "svc.json").write_text(json.dumps({"port": port, "log_level": "warning", "models": [
        {"name": "tiny", "source": str(folder), "dtype": "float32", "placement": {"tensor_parallel": 2},
         "engine": {"num_blocks": 64, "block_size": 4}}]}))
    proc = subprocess.Popen([sys.executable, "-m", "inferflow.service", str(tmp_path / "svc.json")], env=ENV,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the service did not start"
            time.sleep(0.25)
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        followers = _children(proc.pid)
        assert len(followers) == 1, followers
        os.kill(followers[0], signal.SIGKILL)
        time.sleep(0.5)
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and "engine thread stopped" in r.json()["error"]["message"], r.text
        h = httpx.get(url + "/health", timeout=10)
        assert h.status_code == 503 and "engine thread stopped" in h.json()["models"]["tiny"], h.text
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", r.text
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
