"""The starlette application: routes, errors in OpenAI's shape, auth, CORS, metrics, engine lifecycle.

``create_app(config)`` loads the configured models (so a bad config or a missing file fails before the server
binds its port); the lifespan starts each engine's step thread and stops it on shutdown. ``/health`` answers 503
until the engines run.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from .config import ServiceConfig
from .errors import APIError
from .generation import ClientGone
from .native_routes import native
from .openai_chat import chat_completions
from .openai_completions import completions
from .openai_misc import detokenize, embeddings, get_model, list_models, tokenize
from .openapi import openapi_document
from .served_model import ServedModel
from .state import ServiceState

log = logging.getLogger("inferflow.service")


async def health(request: Request) -> Response:
    """200 while every engine runs; 503 while starting or draining, or (with the reasons) when an engine died."""
    state = request.app.state.service
    if not state.ready:
        return Response(status_code=503, headers={"Retry-After": str(max(1, round(state.config.retry_after)))})
    failed = {name: s.failure for name, s in state.models.items() if getattr(s, "failure", None)}
    if failed:
        return JSONResponse({"status": "failed", "models": failed}, status_code=503)
    return Response(status_code=200)


async def metrics(request: Request) -> Response:
    state = request.app.state.service
    state.check_key(request)  # only /health is open: metrics name models and traffic
    text = state.metrics.render({name: s.engine for name, s in state.models.items()})
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


async def openapi(request: Request) -> Response:
    request.app.state.service.check_key(request)
    return JSONResponse(openapi_document(__version__, bool(request.app.state.service.config.api_keys)))


async def version(request: Request) -> Response:
    request.app.state.service.check_key(request)
    return JSONResponse({"version": __version__})


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    what = "Unknown route" if exc.status_code == 404 else exc.detail
    return APIError(exc.status_code, f"{what}: {request.method} {request.url.path}").response()


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nobody reads it: the client left and its request was cancelled


async def _internal(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"Internal error: {type(exc).__name__}: {exc}", code="internal_error").response()


class StatusCounter:
    """Pure ASGI middleware counting responses by route and status (streams are never buffered)."""

    def __init__(self, app: ASGIApp, state: ServiceState, paths: frozenset[str] = frozenset()):
        self.app, self.state, self.paths = app, state, paths

    def route(self, path: str) -> str:
        """The route's template, so arbitrary URLs (scanners, typos) cannot multiply the metric's label values."""
        if path in self.paths:
            return path
        return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.state.metrics.request_done(self.route(scope.get("path", "")), status[0])


def load_models(config: ServiceConfig) -> dict[str, ServedModel]:
    models = {}
    for cfg in config.models:
        log.info("loading model %s", cfg.name)
        models[cfg.name] = ServedModel.load(cfg)
    return models


def create_app(config: ServiceConfig, models: dict[str, Any] | None = None) -> Starlette:
    """The service application; ``models`` (name -> ServedModel) skips loading, e.g. to share models in tests."""
    served = models if models is not None else load_models(config)
    state = ServiceState(config, served)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for s in served.values():
            s.start()
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            for s in served.values():
                s.shutdown()

    routes = [
        Route("/", native, methods=["POST", "PUT"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
    ]
    paths = frozenset(r.path for r in routes if "{" not in r.path)
    middleware = [Middleware(StatusCounter, state=state, paths=paths)]
    if config.cors is not None:  # outermost, so error responses and preflights carry the CORS headers too
        cors = {"allow_origins": ["*"], "allow_methods": ["*"], "allow_headers": ["*"], **config.cors}
        middleware.insert(0, Middleware(CORSMiddleware, **cors))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, ClientGone: _client_gone, ClientDisconnect: _client_gone,
        Exception: _internal})
    app.state.service = state
    return app
