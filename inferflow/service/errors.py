"""HTTP errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the matching status.

Every refusal names what was wrong (the field, the limit, the model) so a client can fix its request without
reading server logs. Overload errors carry ``Retry-After`` so well-behaved clients (the official ``openai`` client
honours it) back off instead of hammering a full server.
"""
from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

# status -> OpenAI error type (what api.openai.com and vLLM send)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "internal_server_error", 503: "service_unavailable"}


class APIError(Exception):
    """A request the service refuses; rendered as an OpenAI error object (or a native one on ``POST /``)."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, int(round(self.retry_after))))}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


def bad_request(message: str, param: str | None = None) -> APIError:
    """400 naming the offending field (``param``) in the message and in ``error.param``."""
    if param and param not in message:
        message = f"{param}: {message}"
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def unauthorized() -> APIError:
    return APIError(401, "Invalid or missing API key: pass it as 'Authorization: Bearer <key>'",
                    code="invalid_api_key")


def model_not_found(name: str, available: list[str]) -> APIError:
    return APIError(404, f"The model '{name}' does not exist; served models: {', '.join(available)}",
                    param="model", code="model_not_found")


def too_large(size: int | None, limit: int) -> APIError:
    got = f"{size} bytes" if size is not None else "more"
    return APIError(413, f"Request body too large: {got}, the limit is {limit} bytes (max_body_bytes)",
                    code="request_too_large")


def overloaded(message: str, status: int = 503, retry_after: float = 1.0) -> APIError:
    return APIError(status, message, code="overloaded", retry_after=retry_after)


def context_overflow(max_len: int, prompt: int, completion: int | None, prompt_kind: str = "prompt") -> APIError:
    """vLLM's wording: both numbers (the context length and what was asked for) appear in the message."""
    asked = prompt + (completion or 0)
    detail = f"{prompt} in the {prompt_kind}" + (f", {completion} in the completion" if completion else "")
    return APIError(400, f"This model's maximum context length is {max_len} tokens. However, you requested "
                         f"{asked} tokens ({detail}). Please reduce the length of the {prompt_kind} or completion.",
                    param="messages" if prompt_kind == "messages" else "prompt", code="context_length_exceeded")
