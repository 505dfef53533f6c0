"""Fast linears over held ggml weights, and the knob that chooses them.

Two kernel sets, picked once per model at load time:

- ``"fast"`` (the default). Q4_0 / Q4_1 / Q4_K weights on a CPU are repacked at load into torch's int4
  weight-only kernel (:mod:`.int4pack`: bf16 compute, within bf16 tolerance of the exact product; the ggml blocks
  are dropped, 5 bits per weight stay). Batches above :data:`INT4_MAX_ROWS` rows (prefill) dequantize that
  packing chunk by chunk into bf16 and use bf16 GEMMs instead, where the kernel's per-row cost exceeds one
  decode of the weight (same bf16 tolerance). Q8_0 keeps its blocks and is decoded exactly (bit-identical
  weights) in cache-sized row chunks, int8 -> float32 times the block scale, into a reused buffer read straight
  from the blocks (no repack: a head tied to the token embedding shares its table), each chunk multiplied at
  once into a preallocated output: 1.4-2x the reference. Every other type (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, Q6_K,
  and Q4 shapes the int4 kernel refuses) runs the reference path: chunking their ggml decoders the same way
  measured no faster (0.8-1.1x).
- ``"reference"``: the blocks are held and every call decodes them with the bit-exact ggml dequantizers
  (:func:`inferflow.quant.packed.packed_linear`); parity tests use it to compare float32 outputs.

Choose with ``inferflow.load(..., quant_kernels="reference")`` or the ``INFERFLOW_QUANT_KERNELS`` environment
variable (the argument wins). Measured speeds: tools/bench_quant_linear.py.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from typing import Iterator

import torch
import torch.nn.functional as F

from ..errors import InferflowError
from . import ggml, int4pack
from .packed import PackedTensor, hold, packed_linear

MODES = ("fast", "reference")
ENV = "INFERFLOW_QUANT_KERNELS"
_selected: contextvars.ContextVar[str | None] = contextvars.ContextVar("quant_kernels", default=None)

# Rows up to which the int4 kernel beats one dequantization of the weight into bf16 GEMMs (the kernel's cost
# grows per row; measured crossover between 96 and 128 rows at N, K = 576..1536 on a 2-core AVX-512 VM with one
# thread, section 2 of tools/bench_quant_linear.py).
INT4_MAX_ROWS = 96
# Chunked paths decode about this many weights at a time: the float chunk (1 MiB in float32) stays in L2 between
# its decode and its matmul (Q8_0 vocab head: 2^17..2^18 beat 2^15, 2^16, 2^19 and the reference's 2^20).
CHUNK_ELEMS = 1 << 18


def _check(mode: str) -> str:
    if mode not in MODES:
        raise InferflowError(f"quant_kernels: unknown {mode!r} (use one of {', '.join(MODES)})")
    return mode


def mode() -> str:
    """The kernel set for weights loaded now: the ``using`` argument, else $INFERFLOW_QUANT_KERNELS, else fast."""
    chosen = _selected.get()
    if chosen is not None:
        return chosen
    env = os.environ.get(ENV)
    return _check(env.strip().lower()) if env else "fast"


@contextlib.contextmanager
def using(kernels: str | None) -> Iterator[None]:
    """Load weights under kernel set ``kernels`` (None: keep the environment's or default choice)."""
    token = _selected.set(_check(kernels) if kernels is not None else None)
    try:
        yield
    finally:
        _selected.reset(token)


def hold_linear(module: torch.nn.Module, name: str, t: PackedTensor) -> None:
    """Hold the linear weight ``name`` in the form the current kernel set runs fastest (see module doc)."""
    kind = mode()
    if kind == "fast" and t.device.type == "cpu" and int4pack.supports(t.qtype, t.shape):
        packed, sz = int4pack.pack(t.data, t.qtype, t.shape)
        del module._parameters[name]
        module.register_buffer(f"{name}_int4", packed, persistent=False)
        module.register_buffer(f"{name}_int4_sz", sz, persistent=False)
        module.packed = {**(getattr(module, "packed", None) or {}), name: (t.qtype, t.shape)}
        kind = "int4"
    else:
        hold(module, name, t)
        kind = "q8_0" if kind == "fast" and t.qtype == ggml.Q8_0 and t.dim() == 2 else "reference"
    module.kernels = {**(getattr(module, "kernels", None) or {}), name: kind}


def linear(module: torch.nn.Module, name: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for a weight held by :func:`hold_linear`."""
    kind = (getattr(module, "kernels", None) or {}).get(name, "reference")
    if kind == "reference" or (kind == "q8_0" and x.device.type != "cpu"):
        return packed_linear(module, name, x, bias)
    qtype, shape = module.packed[name]
    x2 = x.reshape(-1, shape[1])
    if kind == "int4":
        packed, sz = getattr(module, f"{name}_int4"), getattr(module, f"{name}_int4_sz")
        if x.device.type == "cpu" and (x2.shape[0] <= INT4_MAX_ROWS or not int4pack.can_unpack()):
            y = int4pack.matmul(x2, packed, sz)
        else:
            y = int4pack.matmul_dequantized(x2, packed, sz, shape, CHUNK_ELEMS)
    else:
        y = _chunked(x2, shape, _q8_0_decoder(getattr(module, f"{name}_blocks"), shape, x.dtype))
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], shape[0])


def _chunked(x2: torch.Tensor, shape: tuple[int, int], decode) -> torch.Tensor:
    """``x2 @ W^T`` with W decoded ``decode(first_row, rows)`` a chunk at a time, each used at once.

    The output is computed transposed, so every chunk writes one contiguous slab of it."""
    rows, cols = shape
    step = max(1, CHUNK_ELEMS // cols)
    if rows <= step:
        return F.linear(x2, decode(0, rows))
    out = torch.empty(rows, x2.shape[0], dtype=x2.dtype, device=x2.device)
    xt = x2.t()
    for r in range(0, rows, step):
        n = min(step, rows - r)
        torch.mm(decode(r, n), xt, out=out[r:r + n])
    return out.t().contiguous() if x2.shape[0] > 1 else out.view(1, rows)


_local = threading.local()  # one reused decode buffer per thread (servers may run models in worker threads)


def _buffer(numel: int, device: torch.device) -> torch.Tensor:
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < numel or buf.device != device:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode alike
            buf = _local.buf = torch.empty(max(numel, CHUNK_ELEMS), dtype=torch.float32, device=device)
    return buf[:numel]


def _q8_0_decoder(blocks: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype):
    """Q8_0 rows decoded as float(q) * float(d) in float32 (gguf-py's arithmetic, bit-identical) into the reused
    buffer; codes and scales are strided views of the blocks, so nothing is repacked or copied first."""
    rows, cols = shape
    g = cols // 32
    b = blocks.reshape(rows, g, 34)
    codes, scales = b[:, :, 2:].view(torch.int8), b[:, :, :2].view(torch.float16)  # [N, G, 32], [N, G, 1]

    def decode(r: int, n: int) -> torch.Tensor:
        w = _buffer(n * cols, blocks.device).view(n, g, 32)
        w.copy_(codes[r:r + n]).mul_(scales[r:r + n].float())
        w = w.view(n, cols)
        return w if dtype == torch.float32 else w.to(dtype)

    return decode
