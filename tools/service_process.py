"""``inferflow-service`` as a child process for the load and soak tools (and their tests): started on a free
127.0.0.1 port from a config mapping or file, waited for until ``/health`` answers 200, measured (resident
memory from /proc), read (``/metrics`` gauges) and stopped with SIGTERM (the exit status tells whether the
graceful drain worked).
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
_GAUGE = re.compile(r'^inferflow_engine_(\w+)\{model="([^"]*)"\} (\S+)$', re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (Linux /proc; 0 where unavailable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def engine_gauges(url: str, api_key: str | None = None) -> dict[str, dict[str, float]]:
    """``/metrics``' engine gauges by model: {model: {"kv_blocks_used": 0.0, "running": 0.0, ...}}."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(url + "/metrics", headers=headers, timeout=30).text
    out: dict[str, dict[str, float]] = {}
    for key, model, value in _GAUGE.findall(text):
        out.setdefault(model, {})[key] = float(value)
    return out


def wait_idle(url: str, api_key: str | None = None, timeout: float = 30.0) -> dict[str, dict[str, float]]:
    """Wait until no engine runs or queues anything and no KV block is referenced; the last gauges."""
    deadline = time.monotonic() + timeout
    while True:
        g = engine_gauges(url, api_key)
        busy = [m for m, v in g.items() if v.get("running") or v.get("waiting") or v.get("kv_blocks_used")]
        if not busy or time.monotonic() > deadline:
            return g
        time.sleep(0.1)


class ServiceProcess:
    """``python -m inferflow.service CONFIG --port P`` (the ``inferflow-service`` entry point) in a child process."""

    def __init__(self, config: dict[str, Any] | str | os.PathLike, *, port: int | None = None,
                 args: list[str] | None = None, env: dict[str, str] | None = None, threads: int = 1,
                 start_timeout: float = 120.0):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._tmp = None
        if isinstance(config, dict):
            self._tmp = tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False)
            yaml.safe_dump(config, self._tmp)
            self._tmp.close()
            config = self._tmp.name
        self.config_path = str(config)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": str(threads), **(env or {})}
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "inferflow.service", self.config_path, "--port",
                                      str(self.port), *(args or [])], cwd=str(ROOT), env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"inferflow-service did not start:\n{self.output()}")
            time.sleep(0.2)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss(self) -> int:
        return rss_bytes(self.proc.pid)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send ``sig`` and wait; the exit status (killed after ``timeout``: -9)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._tmp is not None:
            Path(self._tmp.name).unlink(missing_ok=True)
        return self.proc.returncode

    def __enter__(self) -> "ServiceProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
