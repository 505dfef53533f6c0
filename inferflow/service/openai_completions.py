"""``POST /v1/completions``: raw prompts (text, token ids, or lists of either), OpenAI's text_completion shape.

Several prompts run as separate engine requests at once; choice ``i * n + j`` is sample ``j`` of prompt ``i``
(vLLM's numbering). Streams interleave the prompts' chunks as they are produced.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .errors import APIError, bad_request
from .framing import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, CancellingStream, sse_event
from .generation import Generation, until_disconnect
from .protocol import check_logprobs, check_type, sampling_params, stream_options
from .responses import TokenText, completion_logprobs, new_id, new_logprobs, now, usage
from .state import open_model_request


def _prompts(body: dict[str, Any], served: Any) -> list[tuple[list[int], str | None]]:
    """(ids, text) per prompt."""
    p = body.get("prompt")
    add_special = body.get("add_special_tokens", True)
    if isinstance(p, str):
        items: list[Any] = [p]
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        items = p
    else:
        raise bad_request("must be a string, a list of strings, a list of token ids or a list of such lists",
                          "prompt")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append((served.encode(item, add_special_tokens=bool(add_special)), item))
        else:
            if not item:
                raise bad_request("a token-id prompt cannot be empty", f"prompt[{i}]")
            served.check_ids(item, "prompt")
            out.append((list(item), None))
    if any(not ids for ids, _ in out):
        raise bad_request("encodes to no tokens", "prompt")
    return out


async def completions(request: Request) -> Response:
    state, body, served = await open_model_request(request, generates=True)
    if body.get("suffix"):
        raise bad_request("suffix is not supported", "suffix")
    so = stream_options(body)
    lp = check_type(body, "logprobs", (int,), "an integer or null")
    if lp is not None and lp < 0:
        raise bad_request(f"{lp} is negative", "logprobs")
    echo = bool(check_type(body, "echo", (bool,), "a boolean"))
    prompts = _prompts(body, served)
    gens: list[Generation] = []
    rid = new_id("cmpl")
    try:
        for ids, _ in prompts:
            params = sampling_params(body, served.cfg.sampling, served.vocab_size, max_tokens_field="max_tokens",
                                     default_max_tokens=16, limits=state.config)
            params.logprobs = lp
            check_logprobs(params, served.cfg.max_logprobs, "logprobs")
            params.max_tokens = served.fit_max_tokens(len(ids), params.max_tokens, "prompt")
            gens.append(Generation(state, served, ids, params, request_id=f"{rid}-{len(gens)}",
                                   cache_salt=check_type(body, "cache_salt", (str,), "a string")))
    except BaseException:
        for g in gens:
            g.close()
        raise
    tt = TokenText(served.tokenizer)
    prefixes = [(text if text is not None else tt.tok.decode(ids)) if echo else "" for ids, text in prompts]
    meta = {"id": rid, "created": now(), "model": served.name}
    n = gens[0].params.n
    if so.stream:
        return CancellingStream(_stream(gens, prefixes, meta, so.include_usage, lp, n, tt), media_type=SSE_MEDIA_TYPE,
                                headers=SSE_HEADERS, on_close=lambda: [g.close() for g in gens])

    async def run_all() -> list[Any]:
        return await asyncio.gather(*(g.result() for g in gens))

    try:
        finals = await until_disconnect(request, run_all(), on_gone=lambda: [g.close() for g in gens])
    finally:
        for g in gens:
            g.close()
    choices = []
    for p, (final, prefix) in enumerate(zip(finals, prefixes)):
        for o in sorted(final.outputs, key=lambda o: o.index):
            logprobs = completion_logprobs(o.token_ids, new_logprobs(o, len(o.token_ids)), lp, tt, len(prefix)) \
                if lp is not None else None
            choices.append({"index": p * n + o.index, "text": prefix + o.text, "logprobs": logprobs,
                            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason})
    return JSONResponse({**meta, "object": "text_completion", "choices": choices, "usage": _usage(gens, finals)})


def _usage(gens: list[Generation], finals: list[Any]) -> dict[str, Any]:
    return usage(sum(len(g.prompt) for g in gens), sum(len(o.token_ids) for f in finals for o in f.outputs),
                 sum(f.num_cached_tokens for f in finals))


async def _merge(gens: list[Generation]) -> AsyncIterator[tuple[int, Any]]:
    """(prompt index, RequestOutput) from all generations as they come."""
    if len(gens) == 1:
        async for out in gens[0].deltas():
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for out in g.deltas():
                await queue.put((i, out))
        except Exception as e:  # surfaces in the stream as an error event
            await queue.put((i, e))
        finally:
            await queue.put((i, end))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _stream(gens: list[Generation], prefixes: list[str], meta: dict[str, Any], include_usage: bool,
                  lp: int | None, n: int, tt: TokenText) -> AsyncIterator[bytes]:
    done: set[int] = set()
    offsets = {}

    def chunk(index: int, text: str, logprobs: Any, finish: str | None, stop_reason: Any = None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        return sse_event({**meta, "object": "text_completion", "choices": [choice]})

    try:
        for p, prefix in enumerate(prefixes):
            if prefix:
                for j in range(n):
                    yield chunk(p * n + j, prefix, None, None)
        async for p, out in _merge(gens):
            for o in out.outputs:
                index = p * n + o.index
                if index in done:
                    continue
                new = o.delta_token_ids
                logprobs = None
                if lp is not None and new:
                    start = offsets.get(index, len(prefixes[p]))
                    logprobs = completion_logprobs(new, new_logprobs(o, len(new)), lp, tt, start)
                    offsets[index] = start + len(o.delta_text)
                if o.finish_reason is not None:
                    done.add(index)
                    yield chunk(index, o.delta_text, logprobs, o.finish_reason, o.stop_reason)
                elif o.delta_text or logprobs:
                    yield chunk(index, o.delta_text, logprobs, None)
        if include_usage:
            finals = [g.final for g in gens]
            if all(f is not None for f in finals):
                yield sse_event({**meta, "object": "text_completion", "choices": [], "usage": _usage(gens, finals)})
    except APIError as e:
        yield sse_event(e.body())
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band, as vLLM does
        yield sse_event(APIError(500, f"{type(e).__name__}: {e}", code="internal_error").body())
    yield SSE_DONE
