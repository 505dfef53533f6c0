"""The request-body parsers of every route, run on a stand-in model (no engine): shared by
tests/test_fuzz_requests.py and the ``request_body`` target of tools/fuzz.py."""
from __future__ import annotations

from typing import Any

from inferflow.service.chat_request import chat_options, top_logprobs_count
from inferflow.service.native_routes import native_params
from inferflow.service.openai_completions import _prompts
from inferflow.service.openai_misc import _inputs
from inferflow.service.protocol import model_name, sampling_params, stream_options
from inferflow.service.served_model import ServedModel

VOCAB, CONTEXT = 64, 128
VALID = {"model": "m", "messages": [{"role": "user", "content": "say json"}], "prompt": "hi", "input": [1, 2],
         "text": "hi", "max_tokens": 4, "temperature": 0.5, "stop": ["x"], "n": 1,
         "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
         "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string"}}}}


class Tok:
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b % VOCAB for b in text.encode("utf-8", "surrogatepass")[:200]]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("latin-1")

    def id_to_token(self, i: int) -> str:
        return chr(i)


class Cfg:
    sampling: dict[str, Any] = {}
    decoding_strategy = None
    prompt_template = encoder_input_template = chat_template = None
    max_logprobs = 20


class Served:
    """What the parsers touch of a ServedModel, with its own checks (check_ids, fit_max_tokens)."""

    name, vocab_size, max_model_len, architecture, generates = "m", VOCAB, CONTEXT, "decoder_only", True
    cfg, tokenizer = Cfg(), Tok()
    check_ids = ServedModel.check_ids
    fit_max_tokens = ServedModel.fit_max_tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text)

    def need_tokenizer(self) -> Tok:
        return self.tokenizer

    def render_chat(self, messages: list[dict[str, Any]], **kw: Any) -> str:
        return "\n".join(m["content"] for m in messages)


SERVED = Served()


def parse(body: dict[str, Any]) -> None:
    """Every parser a route runs on a body, in route order; a refusal stops there, as in the route."""
    model_name(body, ["m"])
    stream_options(body)
    for field in ("max_completion_tokens", "max_tokens"):
        sampling_params(body, {}, VOCAB, max_tokens_field=field, default_max_tokens=None)
    if "messages" in body:
        opts = chat_options(body)
        top_logprobs_count(body, opts)
    if "prompt" in body:
        _prompts(body, SERVED)
    if "input" in body:
        _inputs(body, SERVED)
    native_params(SERVED, body, 3)


def check_body(raw: bytes, where: str) -> None:
    """tools/fuzz.py's oracle for one request body: a 4xx becomes an InferflowError naming ``where`` (a refusal);
    a 5xx or any other exception propagates (a failure)."""
    import json

    from inferflow.errors import InferflowError
    from inferflow.service.errors import APIError

    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise APIError(400, "The request body must be a JSON object")
        parse(body)
    except (ValueError, RecursionError) as e:  # what state.read_json answers with 400
        raise InferflowError(f"{where}: 400 invalid JSON ({type(e).__name__})") from None
    except APIError as e:
        if e.status >= 500:
            raise
        raise InferflowError(f"{where}: {e.status} {e.message}") from None

