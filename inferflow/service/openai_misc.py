"""``GET /v1/models``, ``POST /v1/embeddings`` (encoder-only models), ``POST /tokenize``, ``POST /detokenize``."""
from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .chat_request import chat_options
from .errors import APIError, bad_request, context_overflow
from .protocol import check_type, model_name, require_json_object
from .state import open_model_request, read_json


def _model_card(served: Any) -> dict[str, Any]:
    return {"id": served.name, "object": "model", "created": served.created, "owned_by": "inferflow",
            "root": str(served.cfg.source or served.name), "parent": None, "max_model_len": served.max_model_len,
            "architecture": served.architecture}


async def list_models(request: Request) -> Response:
    state = request.app.state.service
    state.check_key(request)
    return JSONResponse({"object": "list", "data": [_model_card(s) for s in state.models.values()]})


async def get_model(request: Request) -> Response:
    state = request.app.state.service
    state.check_key(request)
    return JSONResponse(_model_card(state.model(request.path_params["model"])))


def _inputs(body: dict[str, Any], served: Any) -> list[list[int]]:
    x = body.get("input")
    if isinstance(x, str):
        items: list[Any] = [x]
    elif isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
        items = [x]
    elif isinstance(x, list) and x and all(isinstance(i, (str, list)) for i in x):
        items = x
    else:
        raise bad_request("must be a string, a list of strings, a list of token ids or a list of such lists", "input")
    out = []
    for item in items:
        ids = served.encode(item) if isinstance(item, str) else list(item)
        if not ids:
            raise bad_request("an input cannot be empty", "input")
        served.check_ids(ids, "input")
        if len(ids) > served.max_model_len:
            raise context_overflow(served.max_model_len, len(ids), None, "input")
        out.append(ids)
    return out


async def embeddings(request: Request) -> Response:
    state, body, served = await open_model_request(request, generates=False)
    fmt = check_type(body, "encoding_format", (str,), "'float' or 'base64'") or "float"
    if fmt not in ("float", "base64"):
        raise bad_request(f"{fmt!r} is not 'float' or 'base64'", "encoding_format")
    dims = check_type(body, "dimensions", (int,), "an integer")
    ids = _inputs(body, served)
    state.slots.acquire()
    t0 = time.perf_counter()
    try:
        vectors = await asyncio.to_thread(served.engine.embed, ids)
    except Exception as e:
        raise APIError(500, f"embedding failed: {e}", code="engine_error") from None
    finally:
        state.slots.release()
    vectors = torch.as_tensor(vectors).float().cpu()
    if dims is not None:
        if not 0 < dims <= vectors.shape[-1]:
            raise bad_request(f"{dims} is not in 1..{vectors.shape[-1]}", "dimensions")
        vectors = torch.nn.functional.normalize(vectors[:, :dims], dim=-1)
    data = []
    for i, v in enumerate(vectors):
        emb: Any = base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() if fmt == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(len(x) for x in ids)
    state.metrics.generation_done(served.name, n, 0, None, time.perf_counter() - t0, ["stop"] * len(ids))
    return JSONResponse({"object": "list", "data": data, "model": served.name,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})


async def tokenize(request: Request) -> Response:
    """vLLM's /tokenize: ``prompt`` (add_special_tokens default true) or chat ``messages`` through the template."""
    state = request.app.state.service
    state.check_key(request)
    body = require_json_object(await read_json(request, state.config.max_body_bytes))
    served = state.model(model_name(body, list(state.models)))
    if "messages" in body:
        opts = chat_options(body)
        text = served.render_chat(opts.messages, add_generation_prompt=opts.add_generation_prompt,
                                  continue_final_message=opts.continue_final_message, tools=opts.tools,
                                  chat_template=opts.chat_template, template_kwargs=opts.template_kwargs)
        add = check_type(body, "add_special_tokens", (bool,), "a boolean")
        ids = served.encode(text, add_special_tokens=bool(add))
    else:
        prompt = check_type(body, "prompt", (str,), "a string")
        if prompt is None:
            raise bad_request("is required (or send 'messages')", "prompt")
        add = check_type(body, "add_special_tokens", (bool,), "a boolean")
        ids = served.encode(prompt, add_special_tokens=True if add is None else add)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": served.max_model_len, "tokens": ids}
    if body.get("return_token_strs"):
        out["token_strs"] = [served.tokenizer.id_to_token(i) for i in ids]
    return JSONResponse(out)


async def detokenize(request: Request) -> Response:
    state = request.app.state.service
    state.check_key(request)
    body = require_json_object(await read_json(request, state.config.max_body_bytes))
    served = state.model(model_name(body, list(state.models)))
    tokens = check_type(body, "tokens", (list,), "a list of token ids")
    if tokens is None:
        raise bad_request("is required", "tokens")
    served.check_ids(tokens, "tokens")
    return JSONResponse({"prompt": served.need_tokenizer().decode(tokens, skip_special_tokens=False)})
