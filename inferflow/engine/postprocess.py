"""What a sampled token does to its sequence (stop checks, text, finish) and the delta outputs streamed from it.

Order per token: EOS (unless ignore_eos) and stop token ids end the sequence without joining its output;
otherwise the token is appended, detokenized and fed to the stop-string checker (whose held-back text never
includes a stop string), then max_tokens and max_model_len are checked.
"""
from __future__ import annotations

from .outputs import CompletionOutput, RequestOutput
from .request import Request, Sequence


def take_token(seq: Sequence, tok: int, logprob: float | None, top: list | None, eos_ids: set[int],
               max_model_len: int) -> tuple[str, str | int | None] | None:
    """Apply a sampled token; returns (finish_reason, stop_reason) when it ends the sequence."""
    p = seq.request.params
    if tok in eos_ids and not p.ignore_eos:
        return "stop", None
    if tok in p.stop_token_ids:
        return "stop", tok
    seq.output_ids.append(tok)
    if seq.logprobs is not None:
        seq.logprobs.append({tok: logprob, **dict(top or ())})
    if seq.detok is not None:
        emit, stopped = seq.stop.feed(seq.detok.add(tok))
        seq.text += emit
        if stopped is not None:
            return "stop", stopped
    if (p.max_tokens is not None and len(seq.output_ids) >= p.max_tokens) or seq.num_tokens >= max_model_len:
        return "length", None
    return None


def close_text(seq: Sequence, reason: str, stop_reason: str | int | None) -> str | int | None:
    """At the end, release text held back (a partial character, a possible stop-string start); returns the
    stop reason (a stop string completed by that very text counts)."""
    if seq.detok is None or reason == "error" or seq.stop.stopped is not None:
        return stop_reason
    emit, stopped = seq.stop.feed(seq.detok.flush())
    seq.text += emit + ("" if stopped else seq.stop.flush())
    return stopped if stopped else stop_reason


def changed(req: Request) -> bool:
    """Anything new to stream since the last output (beam search: only the end; its beams change every step)."""
    if req.params.use_beam_search:
        return req.finished
    for s in req.seqs:  # plain loops: this runs for every request every step
        if len(s.output_ids) > s.sent_tokens or len(s.text) > s.sent_text:
            return True
    return req.finished


def delta_output(req: Request) -> RequestOutput:
    """The request's output now: cumulative text/tokens per sequence plus the deltas since the last one."""
    outs = []
    for s in req.seqs:
        outs.append(CompletionOutput(s.index, s.text, list(s.output_ids), s.text[s.sent_text:],
                                     s.output_ids[s.sent_tokens:], None if s.logprobs is None else list(s.logprobs),
                                     s.finish_reason, s.stop_reason))
        s.sent_tokens, s.sent_text = len(s.output_ids), len(s.text)
    return RequestOutput(req.request_id, req.prompt_ids, outs, req.finished, req.num_cached_tokens, req.error,
                         req.prompt, req.encoder_ids)
