"""One served model: the loaded Model, its Engine, and what routes need from both (prompts, limits, submission)."""
from __future__ import annotations

import inspect
import logging
import time
from typing import Any

from ..errors import InferflowError
from .config import ModelConfig
from .errors import APIError, bad_request, context_overflow, overloaded

log = logging.getLogger("inferflow.service")


def load_model(cfg: ModelConfig, progress: Any = None) -> Any:
    """``inferflow.load`` with the config's source (default: the embedded default model), spec, dtype, device;
    ``progress(done, total)`` is told as weights load."""
    import inferflow

    source = cfg.source
    if not source:
        from ..default_model import default_model_path

        source = default_model_path()
    kw: dict[str, Any] = dict(cfg.overrides)
    if cfg.quantization:
        if "quantization" not in inspect.signature(inferflow.load).parameters:
            raise InferflowError(f"model {cfg.name!r}: quantization {cfg.quantization!r} is not supported by this "
                                 f"build's loader (GGUF files keep their own quantized types)")
        kw["quantization"] = cfg.quantization
    if progress is not None and "progress" in inspect.signature(inferflow.load).parameters:
        kw["progress"] = progress
    try:
        if getattr(cfg, "placement", None) is not None:  # this rank's shard / the CPU-GPU hybrid (docs/placement.md)
            from ..parallel.apply import load_parallel

            return load_parallel(source, cfg.placement, spec=cfg.spec, dtype=cfg.dtype, device=cfg.device, **kw)
        return inferflow.load(source, spec=cfg.spec, dtype=cfg.dtype, device=cfg.device, **kw)
    except InferflowError as e:
        raise InferflowError(f"model {cfg.name!r}: {e}") from None


def _overloaded_types() -> tuple[type, ...]:
    import inferflow.engine.engine as eng

    types = [getattr(eng, "Overloaded", None)]
    try:
        from ..engine import errors as engine_errors  # where the engine may keep its error types

        types.append(getattr(engine_errors, "Overloaded", None))
    except ImportError:
        pass
    return tuple(t for t in types if isinstance(t, type))


class ServedModel:
    """A model plus its engine, named as clients address it (``model`` field, ``/v1/models``)."""

    def __init__(self, cfg: ModelConfig, model: Any, engine: Any = None):
        self.cfg, self.name, self.model = cfg, cfg.name, model
        self.tokenizer = model.tokenizer
        if engine is None:
            from ..engine.engine import Engine

            engine = Engine(model, cfg.engine)
        self.engine = engine
        self.created = int(time.time())
        self.started = False
        self._overloaded = _overloaded_types()

    @classmethod
    def load(cls, cfg: ModelConfig, progress: Any = None) -> "ServedModel":
        return cls(cfg, load_model(cfg, progress))

    # ---- properties ----------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        return self.model.architecture

    @property
    def generates(self) -> bool:
        return self.architecture != "encoder_only"

    @property
    def max_model_len(self) -> int:
        for src in (getattr(self.engine, "max_model_len", None), self.cfg.engine.max_model_len):
            if isinstance(src, int) and src > 0:
                return src
        p = self.model.params
        for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx"):
            v = p.get(key) if isinstance(p, dict) else None
            if isinstance(v, int) and v > 0:
                return v
        return 2048

    @property
    def vocab_size(self) -> int:
        v = self.model.params.get("vocab_size") if isinstance(self.model.params, dict) else None
        return int(v) if v else int(self.tokenizer.vocab_size)

    def start(self) -> None:
        self.engine.start()  # the step thread also runs encoder batches for embeddings
        self.started = True

    @property
    def failure(self) -> str | None:
        """Why this model cannot serve (its engine's step thread died), else None; /health reports it."""
        why = getattr(self.engine, "failure", None)
        if why:
            return f"engine thread stopped: {why}"
        if getattr(self, "started", False) and getattr(self.engine, "background", True) is False:
            return "engine thread is not running"
        return None

    def shutdown(self) -> None:
        self.started = False
        try:
            self.engine.shutdown()
        except Exception:  # shutting down must not hide the reason the service stopped
            log.exception("engine shutdown of %s failed", self.name)

    # ---- prompts -------------------------------------------------------------------------------
    def need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise bad_request(f"model {self.name!r} has no tokenizer; send token ids", "prompt")
        return self.tokenizer

    def chat_template(self, override: str | None = None, tools: Any = None) -> str:
        from ..tokenizers.chat import pick_template

        try:
            return pick_template(self.need_tokenizer(), override or self.cfg.chat_template, tools)
        except InferflowError as e:
            raise bad_request(str(e), "chat_template" if override else "messages") from None

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: Any = None, chat_template: str | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> str:
        from ..tokenizers.chat import render_chat

        template = self.chat_template(chat_template, tools)
        kwargs = {**self.cfg.chat_template_kwargs, **(template_kwargs or {})}
        try:
            text = render_chat(self.tokenizer, messages, add_generation_prompt=add_generation_prompt,
                               chat_template=template, tools=tools, **kwargs)
        except InferflowError as e:
            raise bad_request(str(e), "messages") from None
        if continue_final_message:
            # cut the template's end-of-turn after the final assistant text, so generation continues it
            last = messages[-1].get("content") or ""
            cut = text.rfind(last) if last else -1
            if cut >= 0:
                text = text[:cut + len(last)]
        return text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.need_tokenizer().encode(text, add_special_tokens=add_special_tokens)

    def check_ids(self, ids: list[int], field: str) -> None:
        vocab = self.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad!r} is outside the vocabulary (0..{vocab - 1})", field)

    def fit_max_tokens(self, prompt_len: int, max_tokens: int | None, kind: str, clip: bool = False) -> int:
        """max_tokens settled against the context: None fills it; asking beyond it is a 400 (or clipped)."""
        limit = self.max_model_len
        if prompt_len >= limit or (max_tokens is not None and prompt_len + max_tokens > limit and not clip):
            raise context_overflow(limit, prompt_len, max_tokens, kind)
        room = limit - prompt_len
        return room if max_tokens is None else min(max_tokens, room)

    # ---- submission ----------------------------------------------------------------------------
    def submit(self, prompt: list[int], params: Any, *, encoder_prompt: Any = None, cache_salt: str | None = None,
               request_id: str | None = None, retry_after: float = 1.0) -> Any:
        limit = getattr(getattr(self.engine, "config", None), "max_num_seqs", None) or self.cfg.engine.max_num_seqs
        if params.n > limit:
            raise bad_request(f"{params.n} is more than this model's max_num_seqs ({limit})", "n")
        if self.failure:  # a dead engine thread: refuse rather than queue requests nobody will run
            raise APIError(503, f"model {self.name!r} cannot serve: {self.failure}; the service needs a restart",
                           code="engine_failed")
        kw: dict[str, Any] = {"request_id": request_id}
        if encoder_prompt is not None:
            kw["encoder_prompt"] = encoder_prompt
        if cache_salt is not None:
            kw["cache_salt"] = cache_salt
        try:
            return self.engine.add_request(prompt, params, **kw)
        except self._overloaded as e:
            raise overloaded(f"The server is overloaded ({e}); retry later", 503, retry_after) from None
        except InferflowError as e:
            raise APIError(400, str(e)) from None
