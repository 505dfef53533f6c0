"""The public model object: load, logits, hidden states, generate, embed."""
from __future__ import annotations

import os
from typing import Any, Sequence

import torch

from ..errors import InferflowError
from ..generation.sampling import sample
from ..quant.cpu_kernels import using as using_quant_kernels
from ..spec.params import resolve_params
from ..spec.expr import resolve
from .assembler import assemble
from .context import AttentionBackend, ContiguousKVCache, ForwardContext
from .detect import open_source, resolve_spec
from .flow import Net
from .weights import load_weights

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def as_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise InferflowError(f"dtype: unknown {dtype!r} (use one of {', '.join(_DTYPES)})") from None


class Batch:
    """Ragged or padded input ids packed into one token stream."""

    def __init__(self, ids: Any, attention_mask: Any = None, device: torch.device | None = None):
        self.one_d = False
        if isinstance(ids, torch.Tensor):
            if ids.dim() == 1:
                self.one_d, rows = True, [ids]
            elif ids.dim() == 2:
                if attention_mask is not None:
                    m = torch.as_tensor(attention_mask).bool()
                    rows = [r[mm] for r, mm in zip(ids, m)]
                    self.mask = m
                else:
                    rows = list(ids)
            else:
                raise InferflowError(f"input_ids: expected 1-D or 2-D, got shape {list(ids.shape)}")
        else:
            ids = list(ids)
            if ids and all(isinstance(t, int) for t in ids):
                self.one_d, rows = True, [torch.tensor(ids)]
            else:
                rows = [torch.as_tensor(list(r)) for r in ids]
                if attention_mask is not None:
                    rows = [r[torch.as_tensor(list(mm)).bool()] for r, mm in zip(rows, attention_mask)]
        if not rows or any(r.numel() == 0 for r in rows):
            raise InferflowError("input_ids: every sequence needs at least one token")
        self.lens = [int(r.numel()) for r in rows]
        self.flat = torch.cat([r.long() for r in rows]).to(device)
        self.positions = torch.cat([torch.arange(n) for n in self.lens]).to(device)
        self.width = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else max(self.lens)
        if not hasattr(self, "mask"):
            self.mask = torch.zeros(len(rows), self.width, dtype=torch.bool)
            for b, n in enumerate(self.lens):
                self.mask[b, :n] = True

    def unpack(self, flat: torch.Tensor) -> torch.Tensor:
        """[N, ...] -> [T, ...] for 1-D input, else [B, width, ...] with zeros where the input was padding."""
        if self.one_d:
            return flat
        out = flat.new_zeros((len(self.lens), self.width, *flat.shape[1:]))
        out[self.mask.to(flat.device)] = flat
        return out


class Model:
    """An assembled model with its spec, hyper-parameters, weights and tokenizer."""

    def __init__(self, spec, params: dict[str, Any], net: Net, tokenizer, source, dtype: torch.dtype,
                 device: torch.device):
        self.spec, self.params, self.net, self.tokenizer, self.source = spec, params, net, tokenizer, source
        self.dtype, self.device = dtype, device
        self.config = source.config
        for i, m in enumerate(mod for mod in net.modules() if getattr(mod, "uses_kv_cache", False)):
            m.cache_key = i

    @property
    def architecture(self) -> str:
        return self.spec.architecture

    # ---- forward passes -------------------------------------------------------------------------
    def _context(self, batch: Batch, backend: AttentionBackend, k_lens: list[int] | None = None,
                 token_type_ids: Any = None) -> ForwardContext:
        return ForwardContext(positions=batch.positions, q_lens=batch.lens, k_lens=k_lens or batch.lens,
                              backend=backend, token_type_ids=token_type_ids)

    def _env(self, flat_ids: torch.Tensor, ctx: ForwardContext) -> dict[str, Any]:
        tt = ctx.token_type_ids if ctx.token_type_ids is not None else torch.zeros_like(flat_ids)
        return {"input_ids": flat_ids, "positions": ctx.positions, "token_type_ids": tt}

    def _encode(self, batch: Batch, token_type_ids: Any = None) -> torch.Tensor:
        ctx = self._context(batch, AttentionBackend(), token_type_ids=token_type_ids)
        return self.net.encoder(self._env(batch.flat, ctx), ctx)

    @torch.inference_mode()
    def hidden_states(self, input_ids: Any, *, attention_mask: Any = None, token_type_ids: Any = None,
                      encoder_input_ids: Any = None, encoder_attention_mask: Any = None) -> torch.Tensor:
        """Last hidden states (after the stack's final block): [seq, hidden] or [batch, seq, hidden]."""
        batch = Batch(input_ids, attention_mask, self.device)
        tt = Batch(token_type_ids, attention_mask, self.device).flat if token_type_ids is not None else None
        if self.architecture == "encoder_only":
            return batch.unpack(self._encode(batch, tt)).float()
        return batch.unpack(self._decode(batch, encoder_input_ids, encoder_mask=encoder_attention_mask)).float()

    def _decode(self, batch: Batch, encoder_input_ids: Any, backend: AttentionBackend | None = None,
                k_lens: list[int] | None = None, enc: tuple[torch.Tensor, list[int]] | None = None,
                encoder_mask: Any = None) -> torch.Tensor:
        ctx = self._context(batch, backend or AttentionBackend(), k_lens)
        if self.architecture == "encoder_decoder":
            if enc is None:
                if encoder_input_ids is None:
                    raise InferflowError("encoder_input_ids: required for encoder-decoder models")
                eb = Batch(encoder_input_ids, encoder_mask, self.device)
                enc = (self._encode(eb), eb.lens)
            ctx.encoder_out, ctx.enc_lens = enc
        return self.net.decoder(self._env(batch.flat, ctx), ctx)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.net.head is None:
            raise InferflowError(f"spec {self.spec.name!r} defines no head; use hidden_states()")
        from .context import ForwardContext as _C  # heads are position-free; an empty context suffices

        ctx = _C(positions=torch.zeros(0, dtype=torch.long), q_lens=[hidden.shape[0]], k_lens=[hidden.shape[0]],
                 backend=AttentionBackend())
        return self.net.head({"x": hidden}, ctx).float()

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] of packed last hidden states [N, hidden] through the spec's head (an engine
        applies it to only the rows it needs: sampling rows, masked positions)."""
        return self._head(hidden)

    @torch.inference_mode()
    def logits(self, input_ids: Any, *, encoder_input_ids: Any = None, attention_mask: Any = None,
               token_type_ids: Any = None, encoder_attention_mask: Any = None) -> torch.Tensor:
        """float32 logits: [seq, vocab] for 1-D ids, [batch, seq, vocab] for 2-D or ragged ids."""
        batch = Batch(input_ids, attention_mask, self.device)
        if self.architecture == "encoder_only":
            tt = Batch(token_type_ids, attention_mask, self.device).flat if token_type_ids is not None else None
            hidden = self._encode(batch, tt)
        else:
            hidden = self._decode(batch, encoder_input_ids, encoder_mask=encoder_attention_mask)
        return batch.unpack(self._head(hidden))

    @torch.inference_mode()
    def incremental_logits(self, input_ids: Sequence[int], *, encoder_input_ids: Any = None,
                           chunk: int = 1) -> torch.Tensor:
        """[seq, vocab] logits computed ``chunk`` tokens at a time through the KV cache (checks cache paths)."""
        ids = [int(t) for t in input_ids]
        backend = AttentionBackend(ContiguousKVCache(), slots=[0])
        enc = None
        if self.architecture == "encoder_decoder":
            eb = Batch(encoder_input_ids, None, self.device)
            enc = (self._encode(eb), eb.lens)
        outs = []
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            batch = Batch(part, None, self.device)
            batch.positions = batch.positions + start
            outs.append(self._head(self._decode(batch, None, backend, [start + len(part)], enc)))
        return torch.cat(outs, dim=0)

    @torch.inference_mode()
    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, q_lens: list[int], k_lens: list[int],
                       backend: AttentionBackend, *, encoder_out: torch.Tensor | None = None,
                       enc_lens: list[int] | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """One decoder pass over the packed new tokens of several sequences (an engine step).

        Returns float32 logits of ``rows`` (indices into the N tokens; all when None). ``encoder_out`` /
        ``enc_lens``: packed encoder outputs of the sequences whose cross K/V the backend lacks.
        """
        ctx = ForwardContext(positions=positions, q_lens=list(q_lens), k_lens=list(k_lens), backend=backend)
        ctx.encoder_out, ctx.enc_lens = encoder_out, enc_lens
        hidden = self.net.decoder(self._env(input_ids, ctx), ctx)
        return self._head(hidden if rows is None else hidden.index_select(0, rows))

    @torch.inference_mode()
    def encode_packed(self, ids: Sequence[Sequence[int]]) -> tuple[torch.Tensor, list[int]]:
        """Packed last hidden states [N, hidden] of several sequences and their lengths: the encoder's (encoder
        models; the input of cross-attention) or the cache-less decoder's (decoder-only models)."""
        batch = Batch([list(x) for x in ids], None, self.device)
        hidden = self._encode(batch) if self.net.encoder is not None else self._decode(batch, None)
        return hidden, batch.lens

    # ---- generation -----------------------------------------------------------------------------
    def decoder_start_ids(self) -> list[int]:
        """Decoder prompt of an encoder-decoder request given only its encoder input."""
        # the spec's generation.decoder_start_token_id (may be an expression) wins over config.json
        start = resolve(self.spec.data.get("generation", {}).get("decoder_start_token_id"), self.params)
        if start is None:
            start = self.config.get("decoder_start_token_id")
        return [start if start is not None else 0]

    def _stop_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.config.get("eos_token_id"), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(i for i in src if isinstance(i, int))
        ids.update(getattr(self.tokenizer, "stop_ids", ()))  # includes generation_config / spec extra EOS tokens
        return ids

    @torch.inference_mode()
    def generate_ids(self, prompt_ids: Sequence[int], *, max_new_tokens: int = 64, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, seed: int | None = None, encoder_input_ids: Any = None,
                     stop_ids: set[int] | None = None) -> list[int]:
        """Generate token ids after ``prompt_ids`` with a KV cache (one sequence)."""
        gen = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
        stop = self._stop_ids() if stop_ids is None else stop_ids
        cache = ContiguousKVCache()
        backend = AttentionBackend(cache, slots=[0])
        enc = None
        if self.architecture == "encoder_decoder":
            eb = Batch(encoder_input_ids if encoder_input_ids is not None else prompt_ids, None, self.device)
            enc = (self._encode(eb), eb.lens)
            if encoder_input_ids is None:
                prompt_ids = self.decoder_start_ids()
        ids = list(prompt_ids)
        out: list[int] = []
        pos = 0
        step_ids = ids
        for _ in range(max_new_tokens):
            batch = Batch(step_ids, None, self.device)
            batch.positions = batch.positions + pos
            hidden = self._decode(batch, None, backend, [pos + len(step_ids)], enc)
            pos += len(step_ids)
            logits = self._head(hidden[-1:])
            tok = int(sample(logits.cpu(), temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)[0])
            if tok in stop:
                break
            out.append(tok)
            step_ids = [tok]
        return out

    def generate(self, prompt_or_ids: str | Sequence[int], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, **kw: Any) -> str:
        """Generate a continuation; returns the new text (token ids in, text out when a tokenizer exists)."""
        if isinstance(prompt_or_ids, str):
            if self.tokenizer is None:
                raise InferflowError("generate: this model has no tokenizer; pass token ids")
            ids = self.tokenizer.encode(prompt_or_ids)
        else:
            ids = list(prompt_or_ids)
        out = self.generate_ids(ids, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=seed, **kw)
        return self.tokenizer.decode(out) if self.tokenizer is not None else " ".join(map(str, out))

    # ---- embeddings -----------------------------------------------------------------------------
    @torch.inference_mode()
    def embed(self, texts: str | Sequence[str]) -> torch.Tensor:
        """Pooled (and, per the spec, normalised) sentence embeddings: [n, hidden] float32."""
        if isinstance(texts, str):
            texts = [texts]
        if self.tokenizer is None:
            raise InferflowError("embed: this model has no tokenizer")
        from .pooling import pool_hidden, pooling_for

        pool = pooling_for(self.source, self.spec.data.get("pooling"))
        hidden, lens = self.encode_packed([self.tokenizer.encode(t) for t in texts])
        return pool_hidden(hidden.float(), lens, pool)


def load(source: str | os.PathLike, *, spec: Any = None, dtype: str | torch.dtype | None = None,
         device: str | torch.device | None = None, progress: Any = None, quant_kernels: str | None = None,
         host_embeddings: bool = False, quant: Any = None, quantization: Any = None, **overrides: Any) -> Model:
    """Load a model: ``source`` is a model folder or file; ``spec`` a spec name/path (default: auto-detected);
    ``progress(done, total)`` is called as weights load (a CLI draws a bar); ``quant_kernels``: "fast" (default)
    or "reference" (bit-exact dequantization of block-quantized weights, inferflow/quant/cpu_kernels.py);
    ``host_embeddings``: keep token-embedding tables in host RAM (inferflow/model/placement.py);
    ``quant`` (alias ``quantization``): quantize weights as they load, a format name ("q4") or a per-role config
    (inferflow/quant/plan.py; default: the spec's ``quantization:`` block, if any);
    ``overrides`` replace hyper-parameters by name."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    dt = as_dtype(dtype, dev)
    src = open_source(source)
    sp = resolve_spec(spec, src)
    params = resolve_params(sp, src.kind, src.config, overrides, config_name=src.config_name, arch=src.arch)
    sp.params = params
    net = assemble(sp, params)
    qcfg = quant if quant is not None else quantization if quantization is not None else sp.data.get("quantization")
    quantizer = None
    if qcfg:
        from ..quant.plan import LoadQuantizer, QuantConfig

        quantizer = LoadQuantizer(QuantConfig.parse(qcfg))
    with using_quant_kernels(quant_kernels):
        load_weights(net, sp, src, params, dtype=dt, device=dev, progress=progress, quantizer=quantizer)
    net.eval()
    from ..tokenizers import load_tokenizer

    tok = load_tokenizer(src, sp, params)
    model = Model(sp, params, net, tok, src, dt, dev)
    model.quantizer = quantizer  # what load-time quantization held (None when no config applied)
    if host_embeddings:
        from .placement import place_embeddings

        place_embeddings(model)
    return model
