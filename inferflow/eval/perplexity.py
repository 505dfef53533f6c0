"""Sliding-window perplexity of a causal language model over a text: ``inferflow perplexity MODEL TEXT_FILE``.

The text is tokenized once (special tokens as the model's tokenizer adds them: a BOS only when it prepends one)
and cut into windows of at most ``ctx`` tokens. Each window is one cache-less forward pass; a token is *scored*
when its negative log-likelihood (NLL, natural log, from float32 logits, log-softmax in float64) given the tokens
before it in its window is added to the total. PPL = exp(sum NLL / tokens scored). Two window schemes:

``strided`` (default; Hugging Face's "perplexity of fixed-length models" recipe, ``labels[:-trg_len] = -100``):
  windows start every ``stride`` tokens, ``[begin, min(begin + ctx, n))``, and score only the tokens no earlier
  window scored (targets ``max(prev_end, begin + 1) .. end - 1``), so every token but the text's first is scored
  exactly once, each with at least ``ctx - stride`` tokens of context when stride < ctx. ``stride = ctx`` gives
  disjoint windows where each window's first token is context only (what Inferflow's tool does, ctx 512,
  stride 512). Unlike HF's sample code, the total is a per-token mean, not a mean of per-window means.

``llamacpp`` (llama.cpp's ``llama-perplexity``): ``n // ctx`` disjoint chunks (a partial last chunk is dropped);
  each chunk's first token becomes BOS when the tokenizer adds one, and only its second half is scored (targets
  ``begin + ctx/2 + 1 .. begin + ctx - 1``), so every scored token has at least ctx/2 tokens of context. stride
  must equal ctx.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import InferflowError

MODES = ("strided", "llamacpp")


@dataclass(slots=True, frozen=True)
class Window:
    begin: int  # tokens begin .. end-1 are fed
    end: int
    first: int  # tokens first .. end-1 are scored (first > begin)


@dataclass(slots=True)
class PerplexityResult:
    nll_sum: float           # natural-log NLL summed over the scored tokens
    tokens_scored: int
    windows: int
    tokens_in_text: int
    tokens_fed: int = 0      # tokens run through the model (windows overlap when stride < ctx)
    seconds: float = 0.0
    token_nll: list[float] = field(default_factory=list)  # per scored token, in text order (keep_token_nll)

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.tokens_scored) if self.tokens_scored else float("nan")


def windows(n_tokens: int, ctx: int, stride: int | None = None, mode: str = "strided") -> list[Window]:
    """The windows (tokens fed, tokens scored) of a text of ``n_tokens`` tokens; see the module doc."""
    stride = ctx if stride is None else stride
    if ctx < 2 or stride < 1 or stride > ctx:
        raise InferflowError(f"perplexity: need ctx >= 2 and 1 <= stride <= ctx (ctx {ctx}, stride {stride})")
    if mode == "llamacpp":
        if stride != ctx:
            raise InferflowError("perplexity: the llamacpp mode uses disjoint chunks (stride must equal ctx)")
        return [Window(b, b + ctx, b + ctx // 2 + 1) for b in range(0, n_tokens - ctx + 1, ctx)]
    if mode != "strided":
        raise InferflowError(f"perplexity: unknown mode {mode!r} (use {' or '.join(MODES)})")
    out: list[Window] = []
    prev_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + ctx, n_tokens)
        first = max(prev_end, begin + 1)
        if first < end:
            out.append(Window(begin, end, first))
        prev_end = end
        if end == n_tokens:
            break
    return out


@torch.inference_mode()
def window_nll(model: Any, ids: Sequence[int], first: int) -> torch.Tensor:
    """float64 NLL of tokens ``ids[first:]`` given the ones before them, from one forward pass over ``ids``
    (the head runs only on the rows that predict scored tokens)."""
    from ..model.context import AttentionBackend

    x = torch.as_tensor(list(ids), dtype=torch.long, device=model.device)
    n = x.numel()
    rows = torch.arange(first - 1, n - 1, device=model.device)
    logits = model.forward_packed(x, torch.arange(n, device=model.device), [n], [n], AttentionBackend(), rows=rows)
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(1, x[first:, None]).squeeze(1).cpu()


def perplexity(model: Any, ids: Sequence[int], *, ctx: int = 512, stride: int | None = None, mode: str = "strided",
               progress: Callable[[int, int], None] | None = None, keep_token_nll: bool = False) -> PerplexityResult:
    """Perplexity of ``model`` (decoder-only) on token ids ``ids``; ``progress(done, total)`` after each window."""
    if getattr(model, "architecture", "decoder_only") != "decoder_only" or model.net.head is None:
        raise InferflowError(f"perplexity: needs a decoder-only model with a head (got {model.architecture})")
    ids = [int(t) for t in ids]
    wins = windows(len(ids), ctx, stride, mode)
    if not wins:
        raise InferflowError(f"perplexity: {len(ids)} tokens give no window to score (ctx {ctx}, mode {mode})")
    bos = getattr(model.tokenizer, "bos_token_id", None) if getattr(model.tokenizer, "add_bos", False) else None
    total, scored, per_token = 0.0, 0, []
    t0 = time.perf_counter()
    for k, w in enumerate(wins):
        part = ids[w.begin:w.end]
        if mode == "llamacpp" and bos is not None:
            part[0] = bos  # llama.cpp puts BOS in each chunk's first slot (context only, never scored)
        nll = window_nll(model, part, w.first - w.begin)
        total += float(nll.sum())
        scored += nll.numel()
        if keep_token_nll:
            per_token.extend(nll.tolist())
        if progress is not None:
            progress(k + 1, len(wins))
    fed = sum(w.end - w.begin for w in wins)
    return PerplexityResult(total, scored, len(wins), len(ids), fed, time.perf_counter() - t0, per_token)


def tokenize_file(model: Any, path: str, limit_tokens: int | None = None) -> list[int]:
    if model.tokenizer is None:
        raise InferflowError("perplexity: this model has no tokenizer")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise InferflowError(f"perplexity: cannot read {path}: {e.strerror}") from None
    ids = model.tokenizer.encode(text)
    return ids[:limit_tokens] if limit_tokens else ids


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="inferflow perplexity",
                                 description="Sliding-window perplexity of a causal LM on a text file.")
    ap.add_argument("model", help="model file or folder")
    ap.add_argument("text_file", help="UTF-8 text to score")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per window (default 512)")
    ap.add_argument("--stride", type=int, help="tokens between window starts (default: ctx)")
    ap.add_argument("--mode", choices=MODES, default="strided",
                    help="strided: HF's recipe, every token scored once (default); llamacpp: disjoint chunks, "
                         "second half of each scored")
    ap.add_argument("--quant", help="quantize at load: a format (q8 q6 q5 q4 q3.5 q3 q2 q8_0 q4_0 ...) or a JSON "
                                    "per-role mapping")
    ap.add_argument("--dtype", help="float32 (CPU default), bfloat16, float16")
    ap.add_argument("--device")
    ap.add_argument("--spec", help="spec name or file (default: auto-detected)")
    ap.add_argument("--limit-tokens", type=int, help="score only the first N tokens of the text")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    ap.add_argument("--progress", action="store_true", help="draw the progress bar even when stderr is no terminal")
    return ap


def perplexity_main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    from ..service.progress import LoadBar

    try:
        import inferflow

        if args.threads:
            torch.set_num_threads(args.threads)
        quant: Any = args.quant
        if quant and quant.lstrip().startswith("{"):
            quant = json.loads(quant)
        with LoadBar("loading", force=args.progress) as bar:
            model = inferflow.load(args.model, spec=args.spec, dtype=args.dtype, device=args.device, quant=quant,
                                   progress=bar)
        ids = tokenize_file(model, args.text_file, args.limit_tokens)
        stride = args.stride or args.ctx
        with LoadBar("perplexity", force=args.progress) as bar:
            r = perplexity(model, ids, ctx=args.ctx, stride=stride, mode=args.mode, progress=bar)
    except (InferflowError, json.JSONDecodeError) as e:
        print(f"inferflow perplexity: {e}", file=sys.stderr)
        return 2
    print(f"PPL = {r.ppl:.4f} over {r.tokens_scored} tokens scored ({r.windows} windows, ctx {args.ctx}, "
          f"stride {stride}, mode {args.mode}; {r.tokens_in_text} tokens of text; NLL sum {r.nll_sum:.4f})")
    print(f"{r.seconds:.1f} s, {r.tokens_fed / max(r.seconds, 1e-9):.0f} tokens/s evaluated", file=sys.stderr)
    return 0
