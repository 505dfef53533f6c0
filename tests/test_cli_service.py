"""``python -m inferflow.service config`` (the ``inferflow-service`` entry point) as a real process, configured by an
Inferflow-style INI file; a config error is reported with the file and key and exit status 2."""
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

from service_helpers import chat_llama, free_port

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_service_process_from_ini(tmp_path):
    chat_llama(tmp_path / "tiny")  # the model folder the ini names
    port = free_port()
    ini = tmp_path / "inferflow_service.ini"
    ini.write_text(textwrap.dedent(f"""
        [main]
        http_port = {port}
        worker_count = 32
        api_keys = sk-ini

        [transformer_engine]
        models = tiny

        [model.tiny]
        model_dir = ${{config_dir}}/tiny
        decoding_strategy = greedy
        prompt_template = {{bos}}user: {{query}}{{\\n}}assistant:{{res_prefix}}
        engine.num_blocks = 32
        """))
    proc = subprocess.Popen([sys.executable, "-m", "inferflow.service", str(ini)], cwd=str(ROOT), env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.2)
        auth = {"Authorization": "Bearer sk-ini"}
        r = httpx.post(url + "/", json={"text": "hello", "is_streaming_mode": False, "max_new_tokens": 3}, headers=auth)
        assert r.status_code == 200 and r.json()["ret_code"] == "succ"
        assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"serving tiny on http://127.0.0.1:{port}" in out


def test_service_config_error_exit_status(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: 8080\nmodels:\n  - name: a\n    engine: {max_num_seqs: 0}\n")
    out = subprocess.run([sys.executable, "-m", "inferflow.service", str(bad)], cwd=str(ROOT), env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "bad.yaml" in out.stderr and "max_num_seqs" in out.stderr
