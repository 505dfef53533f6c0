"""What every route shares: the config, the served models, metrics, concurrency slots; body reading and auth."""
from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.requests import Request

from .config import ServiceConfig
from .errors import APIError, bad_request, model_not_found, too_large, unauthorized
from .generation import Slots
from .metrics import ServiceMetrics
from .protocol import model_name, require_json_object


class ServiceState:
    def __init__(self, config: ServiceConfig, models: dict[str, Any]):
        self.config, self.models = config, models
        self.metrics = ServiceMetrics()
        self.slots = Slots(config.max_concurrent_requests, config.retry_after, self.metrics)
        self.ready = False
        self.live: set[Any] = set()   # in-flight Generations (a draining shutdown cancels them)
        self._keys = [k.encode("utf-8") for k in config.api_keys]

    def model(self, name: str) -> Any:
        served = self.models.get(name)
        if served is None:
            raise model_not_found(name, list(self.models))
        return served

    def default_model(self) -> Any:
        return next(iter(self.models.values()))

    def check_key(self, request: Request, body_key: str | None = None) -> None:
        """401 unless a configured key is presented (Bearer token, x-api-key, or the native body's passcode).

        Every configured key is compared, in constant time, so timing reveals neither a key nor which one matched.
        """
        if not self._keys:
            return
        presented = []
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            presented.append(auth[7:].strip())
        if request.headers.get("x-api-key"):
            presented.append(request.headers["x-api-key"])
        if body_key:
            presented.append(body_key)
        ok = False
        for p in presented:
            pb = p.encode("utf-8")
            for k in self._keys:
                ok |= hmac.compare_digest(pb, k)
        if not ok:
            raise unauthorized()

    def cancel_all(self) -> int:
        """Cancel every in-flight generation (their streams end with finish_reason "abort"); how many."""
        gens = list(self.live)
        for g in gens:
            try:
                g.handle.cancel()
            except Exception:  # noqa: BLE001 - a stopped engine: nothing left to cancel
                pass
        return len(gens)

    def check_ready(self) -> None:
        if not self.ready:
            raise APIError(503, "The service is starting or stopping; retry later", code="not_ready",
                           retry_after=self.config.retry_after)


async def read_json(request: Request, limit: int) -> Any:
    """The JSON body, refusing (413) more than ``limit`` bytes before reading them when Content-Length says so."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(None, limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise APIError(400, "The request body is empty; send a JSON object", code="invalid_request")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, over-long integers, absurd nesting
        raise APIError(400, f"The request body is not valid JSON: {type(e).__name__}: {e}", code="invalid_json") \
            from None


async def open_model_request(request: Request, *, generates: bool) -> tuple[Any, dict[str, Any], Any]:
    """The common start of an OpenAI route: API key, JSON body, readiness and the named model of the right kind
    (a generating model, or an encoder-only one for embeddings). Returns (state, body, served model)."""
    state = request.app.state.service
    state.check_key(request)
    body = require_json_object(await read_json(request, state.config.max_body_bytes))
    state.check_ready()
    served = state.model(model_name(body, list(state.models)))
    if generates and not served.generates:
        raise bad_request(f"{served.name!r} is an embedding model; use /v1/embeddings", "model")
    if not generates and served.generates:
        raise bad_request(f"{served.name!r} generates text; embeddings need an encoder-only model", "model")
    return state, body, served
