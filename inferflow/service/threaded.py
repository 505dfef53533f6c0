"""An app served by uvicorn from a background thread of this process, on 127.0.0.1 (a free port unless given):
what `inferflow bench` starts when no URL is given, and what the tests serve through."""
from __future__ import annotations

import socket
import threading
import time
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadedServer:
    """uvicorn serving ``app`` on 127.0.0.1 from a daemon thread; ``url`` once started; ``stop()`` or a ``with``."""

    def __init__(self, app: Any, port: int | None = None, start_timeout: float = 30.0):
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=timeout)

    def __enter__(self) -> "ThreadedServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
