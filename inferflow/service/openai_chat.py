"""``POST /v1/chat/completions``: the whole conversation through the model's chat template, OpenAI's response.

Streams are SSE: a first chunk per choice with ``delta.role``, content deltas, a last chunk per choice with its
``finish_reason``, the usage chunk (``stream_options.include_usage``), then ``data: [DONE]``. With tools, text is
streamed until the template's tool-call marker appears; the calls are parsed when the choice ends.
"""
from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .chat_request import ChatOptions, chat_options, top_logprobs_count
from .errors import APIError
from .framing import SSE_DONE, SSE_HEADERS, SSE_MEDIA_TYPE, CancellingStream, sse_event
from .generation import Generation
from .guided import apply_chat_guidance
from .protocol import StreamOptions, check_logprobs, check_type, sampling_params, stream_options
from .responses import TokenText, chat_logprobs, new_id, new_logprobs, now, usage
from .state import open_model_request
from .tool_calls import ToolParser, ToolStream, parser_for


async def chat_completions(request: Request) -> Response:
    state, body, served = await open_model_request(request, generates=True)
    opts = chat_options(body)
    so = stream_options(body)
    params = sampling_params(body, served.cfg.sampling, served.vocab_size, max_tokens_field="max_completion_tokens",
                             default_max_tokens=None, limits=state.config)
    params.logprobs = top_logprobs_count(body, opts)
    check_logprobs(params, served.cfg.max_logprobs, "top_logprobs")
    text = served.render_chat(opts.messages, add_generation_prompt=opts.add_generation_prompt,
                              continue_final_message=opts.continue_final_message, tools=opts.tools,
                              chat_template=opts.chat_template, template_kwargs=opts.template_kwargs)
    ids = served.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))
    params.max_tokens = served.fit_max_tokens(len(ids), params.max_tokens, "messages")
    parser = parser_for(served.chat_template(opts.chat_template, opts.tools)) if opts.tools_active else None
    parser = apply_chat_guidance(params, opts, parser)  # response_format, forced tool calls -> guided decoding
    salt = check_type(body, "cache_salt", (str,), "a string")
    rid = new_id("chatcmpl")
    gen = Generation(state, served, ids, params, cache_salt=salt, request_id=rid)
    meta = {"id": rid, "created": now(), "model": served.name}
    top = params.logprobs or 0
    if so.stream:
        return CancellingStream(_stream(gen, opts, so, parser, meta, top, TokenText(served.tokenizer)),
                                media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS, on_close=gen.close)
    final = await gen.result(request)
    tt = TokenText(served.tokenizer)
    choices = []
    for o in sorted(final.outputs, key=lambda o: o.index):
        content, calls = parser.parse(o.text) if parser is not None else (o.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        lp = chat_logprobs(o.token_ids, gen_logprobs(gen, o), top, tt) if opts.logprobs else None
        choices.append({"index": o.index, "message": message, "logprobs": lp,
                        "finish_reason": "tool_calls" if calls else o.finish_reason, "stop_reason": o.stop_reason})
    completion = sum(len(o.token_ids) for o in final.outputs)
    return JSONResponse({**meta, "object": "chat.completion", "choices": choices,
                         "usage": usage(len(ids), completion, final.num_cached_tokens)})


def gen_logprobs(gen: Generation, output: Any) -> list[dict[int, float]]:
    """All logprob entries of a finished output (the engine's list is cumulative)."""
    return new_logprobs(output, len(output.token_ids))


async def _stream(gen: Generation, opts: ChatOptions, so: StreamOptions, parser: ToolParser | None,
                  meta: dict[str, Any], top: int, tt: TokenText) -> AsyncIterator[bytes]:
    n = gen.params.n
    streams = [ToolStream(parser) if parser is not None else None for _ in range(n)]
    done: set[int] = set()
    produced = [0] * n

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None,
              stop_reason: Any = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        event: dict[str, Any] = {**meta, "object": "chat.completion.chunk", "choices": [choice]}
        if so.continuous_usage_stats:
            event["usage"] = usage(len(gen.prompt), sum(produced))
        return sse_event(event)

    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for out in gen.deltas():
            for o in out.outputs:
                if o.index in done:
                    continue
                produced[o.index] = len(o.token_ids)
                new = o.delta_token_ids
                lp = chat_logprobs(new, new_logprobs(o, len(new)), top, tt) if opts.logprobs and new else None
                ts = streams[o.index]
                text = ts.feed(o.delta_text) if ts is not None else o.delta_text
                if o.finish_reason is None:
                    if text or lp:
                        yield chunk(o.index, {"content": text}, lp)
                    continue
                done.add(o.index)
                rest, calls = ts.finish() if ts is not None else ("", [])
                delta: dict[str, Any] = {}
                if text + rest:
                    delta["content"] = text + rest
                if calls:
                    delta["tool_calls"] = [{"index": j, **c.to_openai()} for j, c in enumerate(calls)]
                yield chunk(o.index, delta, lp, "tool_calls" if calls else o.finish_reason, o.stop_reason)
        if so.include_usage and gen.final is not None:
            final = gen.final
            yield sse_event({**meta, "object": "chat.completion.chunk", "choices": [],
                             "usage": usage(len(gen.prompt), sum(len(o.token_ids) for o in final.outputs),
                                            final.num_cached_tokens)})
    except APIError as e:
        yield sse_event(e.body())
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band, as vLLM does
        yield sse_event(APIError(500, f"{type(e).__name__}: {e}", code="internal_error").body())
    yield SSE_DONE
