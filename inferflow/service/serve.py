"""Running the application under uvicorn with a graceful shutdown.

On SIGTERM (or the first Ctrl-C) the service drains: uvicorn closes the listening socket, ``/health`` and new
requests on open connections answer 503 (Retry-After), and in-flight generations may finish for
``shutdown_grace`` seconds. Those still running then are cancelled through the engine, so each client still gets
a properly terminated response (a last chunk with ``finish_reason: "abort"`` and ``data: [DONE]``, or a
non-streaming answer with the partial text), their KV blocks are freed, the engines stop, and the process exits 0.
A second Ctrl-C quits at once (uvicorn's behaviour).
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Any

import uvicorn

log = logging.getLogger("inferflow.service")

# uvicorn re-raises the signal that stopped it once it has shut down; with the default SIGTERM action that would
# kill the process after a clean drain (exit status -15), so the re-raised signal meets a no-op handler instead
_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown first stops admission, then cancels what is left after the grace period."""

    def __init__(self, config: uvicorn.Config, state: Any, grace: float):
        super().__init__(config)
        self.state, self.grace = state, grace

    async def shutdown(self, sockets: Any = None) -> None:
        self.state.ready = False  # /health and new requests: 503 from now on
        live = len(self.state.live)
        if live:
            log.info("draining %d in-flight request(s) for up to %.1f s", live, self.grace)
        timer = asyncio.get_running_loop().call_later(self.grace, self._cancel_rest)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _cancel_rest(self) -> None:
        n = self.state.cancel_all()
        if n:
            log.warning("shutdown grace of %.1f s is over: cancelled %d request(s)", self.grace, n)


def _ignore(signum: int, frame: Any) -> None:
    pass


def run_server(app: Any, config: Any) -> None:
    """Serve ``app`` (create_app's) on ``config.host:config.port`` until SIGTERM / SIGINT, then drain and return."""
    grace = float(getattr(config, "shutdown_grace", 30.0))
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                        timeout_graceful_shutdown=grace + 5.0)  # the last resort: uvicorn cancels the tasks
    server = DrainingServer(uv, app.state.service, grace)
    main = threading.current_thread() is threading.main_thread()
    before = {s: signal.signal(s, _ignore) for s in _SIGNALS} if main else {}
    try:
        server.run()
    finally:
        for s, h in before.items():
            signal.signal(s, h)
