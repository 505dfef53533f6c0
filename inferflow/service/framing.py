"""Wire framing of streamed responses: SSE for the OpenAI routes, newline-delimited JSON for the native route.

Each frame is encoded from whole Python strings, so no frame ever ends inside a multi-byte UTF-8 character; the
engine's detokenizer already holds back incomplete characters, and ``Utf8Guard`` keeps that promise for text from
anywhere else (a U+FFFD at the end of a delta is held until the next delta shows whether it was a partial character).
"""
from __future__ import annotations

import json
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_MEDIA_TYPE = "text/event-stream"
NDJSON_MEDIA_TYPE = "application/x-ndjson"
SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_event(obj: Any) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return f"data: {dumps(obj)}\n\n".encode("utf-8")


def ndjson_line(obj: Any) -> bytes:
    return (dumps(obj) + "\n").encode("utf-8")


class Utf8Guard:
    """Holds back a trailing replacement character until the text after it arrives (or the stream ends)."""

    def __init__(self) -> None:
        self.pending = ""

    def feed(self, text: str, final: bool = False) -> str:
        text = self.pending + text
        self.pending = ""
        if not final:
            cut = len(text)
            while cut > 0 and text[cut - 1] == "\ufffd":
                cut -= 1
            text, self.pending = text[:cut], text[cut:]
        return text


class CancellingStream(StreamingResponse):
    """A StreamingResponse that stops its generator as soon as the client disconnects, whatever the ASGI version.

    Starlette notices a disconnect only on the next write under ASGI 2.4; a request waiting in the engine's queue
    would keep its place (and later its KV blocks) until then. Here a disconnect cancels the generator at once,
    and ``aclose`` always runs, so the generator's ``finally`` cancels the engine request; ``on_close`` runs last
    (a generator that never started has no ``finally`` to run).
    """

    def __init__(self, content: Any, *, on_close: Any = None, **kw: Any):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.body_iterator
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass  # the client went away mid-write
                    tg.cancel_scope.cancel()

                async def listen() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(listen)
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            if self.on_close is not None:
                self.on_close()
