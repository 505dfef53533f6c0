"""Fast linears over held ggml weights, and the knob that chooses them.

Two kernel sets, picked once per model at load time:

- ``"fast"`` (the default). Where the native kernels build (:mod:`inferflow.native`, ``$INFERFLOW_NATIVE``), Q4_0 /
  Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q6_K weights (and Q4_K in shapes the int4 kernel refuses: :data:`INT4_OVER_NATIVE`) on
  a CPU, the Q8_0 vocab head included, keep their ggml blocks as stored (kind ``"native"``, :mod:`.native_linear`):
  a C kernel decodes them in registers with the reference's arithmetic (bit-identical weights) and sums in float32
  in a fixed order per output element (the same bits for any row count and thread count), streaming the weight once
  for up to :data:`NATIVE_MAX_ROWS` rows; larger batches (prefill) decode the weight once per call into a reused
  buffer, :data:`NATIVE_DECODE_ELEMS` at a time, for bf16 GEMMs (:data:`NATIVE_PREFILL_BF16`; vocab heads: exact
  float32 ones). Fused q/k/v and gate/up linears concatenate their block rows (model/fuse.py).
  Decode calls of Q4_0 / Q4_1 / Q8_0 weights (vocab heads too) take llama.cpp's arithmetic instead where the CPU
  has AVX512-VNNI: activations quantized to int8 per 32-block, integer dot products of 16 weight rows at a time
  (gemv_q8x.h; ~5e-3 relative error, as llama.cpp's q8_0 activations; 1.3-2x the exact decode, which left these
  types compute-bound). ``$INFERFLOW_NATIVE_Q8X=0`` keeps the exact decode (:func:`native_q8x`). Prefill-sized
  calls keep the bf16 GEMMs below: int8 activations there too (llama.cpp's way) turned
  the default model's answer to tests/test_default_model.py's question from "Paris" into llama.cpp's own wrong one. Measured: tools/bench_native_quant.py. Everything below is what runs where the
  native kernels are unavailable (no compiler, ``INFERFLOW_NATIVE=0``) or for other types: Q4_0 / Q4_1 / Q4_K
  weights on a CPU are repacked at load into torch's int4 weight-only kernel (:mod:`.int4pack`: bf16 compute, within
  bf16 tolerance of the exact product; the ggml blocks are dropped, 5 bits per weight stay). Batches above
  :data:`INT4_MAX_ROWS` rows (prefill) decode that packing once per call, transposed, into a reused bf16 buffer
  (int4pack.dequantize_t) and run one bf16 GEMM instead, where the kernel's per-row cost exceeds one decode of the
  weight (same bf16 tolerance; 2-2.5x the kernel at 128 rows). A decode step's calls (M = 1) go straight to the
  kernel: one bf16 cast in, one float cast out. Q8_0 runs the int4 kernel as two nibble planes (int4pack.py, 10 bits
  per weight) except vocab-sized heads (:data:`Q8_INT4_MAX_N`, logits: exactness kept the greedy answer) and refused
  shapes. Vocab heads up to :data:`DENSE_MAX_ELEMS` are decoded once at load into float32 ("dense": bit-identical
  weights, one GEMV per step, 2.0-2.2x the chunked decoder below at the default model's 49152 x 576 head; the exact
  alternatives measured slower: int8 codes with per-block partial sums through ``torch._int_mm`` or
  ``_weight_int8pack_mm`` per block; no CPU op takes bf16 codes into float32 outputs). Larger heads and refused
  shapes keep their blocks and are decoded exactly (bit-identical weights) in cache-sized row chunks, int8 ->
  float32 times the block scale, into a reused buffer read straight from the blocks (no repack), each chunk
  multiplied at once into a preallocated output: 1.4-2x the reference. Every other type (Q5_0, Q5_1, Q2_K, Q3_K,
  Q5_K, Q6_K, and Q4 shapes the int4 kernel refuses) runs the reference path. inferflow's own formats all run the
  int4 kernel (q4, q3, q2: one part; q6, q5, Q8_0: two; q3.5: three, side by side along K in one call: formats.py
  registers them), or, in shapes it refuses, q3.5 decodes whole into a per-thread buffer reused by every linear of
  that shape and runs one matmul. (For the ggml types left on the reference path, chunking their decoders like Q8_0
  measured no faster: 0.8-1.1x.)
- ``"reference"``: the blocks are held and every call decodes them with the bit-exact ggml dequantizers
  (:func:`inferflow.quant.packed.packed_linear`); parity tests use it to compare float32 outputs.

On a CUDA device, the fast set runs Q8_0 (q8), Q4_0 and inferflow's q4 weights through Triton kernels that
dequantize in registers (:mod:`.triton_kernels`, when triton imports); other types take the reference path there.

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
from . import ggml, int4pack, native_linear, triton_kernels
from .packed import PackedTensor, hold, packed_linear

MODES = ("fast", "reference")
ENV = "INFERFLOW_QUANT_KERNELS"
_selected: contextvars.ContextVar[str | None] = contextvars.ContextVar("quant_kernels", default=None)

# Rows up to which the int4 kernel beats decoding its weight once per call into bf16 W^T + one bf16 GEMM (the
# kernel's cost grows per row, the decode's does not: 3 default-model layers of linears, 1 thread, 2-core AVX-512
# VM, /tmp bench as tools/bench_quant_linear.py section 2: kernel/decode 0.66 at M = 32, 1.04 at 48, 1.25 at 64,
# 2-2.5 at 128; the earlier row-major decode crossed only at 96-128).
INT4_MAX_ROWS = 48
# Chunked paths decode about this many weights at a time: the float chunk (1 MiB in float32) stays in L2 between
# its decode and its matmul (Q8_0 vocab head: 2^17..2^18 beat 2^15, 2^16, 2^19 and the reference's 2^20).
CHUNK_ELEMS = 1 << 18
# Q8_0 weights with at least this many output rows (vocab projections: logits) stay on the exact chunked decoder
# instead of the int4 planes: the kernel's bf16 OUTPUT rounds logits near 25 to steps of 0.125, which tied and
# flipped the default model's greedy answer (tests/test_default_model.py "Paris"; the exact head keeps it).
Q8_INT4_MAX_N = 16384
# Such vocab-sized Q8_0 weights up to this many elements (512 MiB in float32) are held decoded in float32 (kernel
# "dense"): exact, and the fastest exact form measured (see the module doc); larger ones keep the chunked decoder.
DENSE_MAX_ELEMS = 1 << 27
# Native kernel (kind "native", quant/native_linear.py): calls of up to this many rows run the block GEMV; larger
# ones (prefill) decode the weight NATIVE_DECODE_ELEMS at a time and run GEMMs (bf16: NATIVE_PREFILL_BF16).
# Crossover against the bf16 decode + GEMM, 1 thread (Q4_0 / Q8_0, 3072x576 and 576x1536; GEMM path / kernel
# time): 1.4-1.8 at 8 rows, 1.0-1.5 at 12, 0.75-1.2 at 16, 0.6-0.9 at 24 (against the float32 GEMM: 1.35-1.8 at
# 16, 0.65-1.15 at 32). Up to this many rows, batched decoding gives the same bits as one sequence at a time.
NATIVE_MAX_ROWS = 16
# Larger batches decode native-held weights (but vocab heads) to bf16 and run bf16 GEMMs, as the int4 path does
# (bf16 tolerance). 128-token prefill, 1 thread, q4_0 / q8_0 class files: 1.7x / 2.1x the exact float32 decode +
# GEMM, 1.4x / 3.1x the int4 path's (INFERFLOW_NATIVE=0). False: exact float32 for every weight.
NATIVE_PREFILL_BF16 = True
# Types the native kernel decodes but the int4 kernel runs faster where it takes the shape (bf16 tolerance instead
# of exact): Q4_K, whose sub-blocks carry their own scale and min, measured 0.5x the int4 kernel at 576 x 1536
# (M = 1 and 8, 1 thread; tools/bench_native_quant.py --types Q4_K).
INT4_OVER_NATIVE = frozenset({ggml.Q4_K})
NATIVE_DECODE_ELEMS = 1 << 22


_prefer_triton: contextvars.ContextVar[bool] = contextvars.ContextVar("prefer_triton", default=False)


@contextlib.contextmanager
def prefer_triton(on: bool = True) -> Iterator[None]:
    """Hold weights for the Triton kernels even off CUDA (tests: the kernels under TRITON_INTERPRET=1 on a CPU)."""
    token = _prefer_triton.set(on)
    try:
        yield
    finally:
        _prefer_triton.reset(token)


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
    if kind == "fast" and (t.device.type == "cuda" or _prefer_triton.get()) and \
            triton_kernels.supports(t.qtype, t.shape, t.device):
        hold(module, name, t)  # blocks stay as they are: the Triton kernels read them (quant/triton_kernels.py)
        module.kernels = {**(getattr(module, "kernels", None) or {}), name: "triton"}
        return
    if kind == "fast" and t.device.type == "cpu" and t.dim() == 2 and native_linear.available(t.qtype) and \
            not (t.qtype in INT4_OVER_NATIVE and int4pack.supports(t.qtype, t.shape)):
        hold(module, name, t)  # the native kernel reads the blocks as stored (quant/native_linear.py)
        module.kernels = {**(getattr(module, "kernels", None) or {}), name: "native"}
        return
    vocab = t.qtype == ggml.Q8_0 and t.dim() == 2 and t.shape[0] >= Q8_INT4_MAX_N
    if kind == "fast" and t.device.type == "cpu" and vocab and t.shape[0] * t.shape[1] <= DENSE_MAX_ELEMS:
        # the exact logits: the float32 weight, decoded once (bit-identical to the reference's decode)
        del module._parameters[name]
        module.register_buffer(f"{name}_dense", ggml.dequantize(t.data, t.qtype, t.shape, torch.float32),
                               persistent=False)
        module.packed = {**(getattr(module, "packed", None) or {}), name: (t.qtype, t.shape)}
        kind = "dense"
    elif kind == "fast" and t.device.type == "cpu" and int4pack.supports(t.qtype, t.shape) and not vocab:
        del module._parameters[name]
        # q5/q6/Q8_0: parts (bit planes) whose sum is the weight, packed side by side along K (int4pack.pack)
        packed, sz = int4pack.pack(t.data, int4pack.parts_of(t.qtype), t.shape)
        module.register_buffer(f"{name}_int4", packed, persistent=False)
        module.register_buffer(f"{name}_int4_sz", sz, persistent=False)
        module.packed = {**(getattr(module, "packed", None) or {}), name: (t.qtype, t.shape)}
        kind = "int4"
    else:
        hold(module, name, t)
        fast2d = kind == "fast" and t.dim() == 2
        kind = "q8_0" if fast2d and t.qtype == ggml.Q8_0 else \
            "buffer" if fast2d and t.qtype in BUFFERED else "reference"
    module.kernels = {**(getattr(module, "kernels", None) or {}), name: kind}


def linear(module: torch.nn.Module, name: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for a weight held by :func:`hold_linear`."""
    kind = (getattr(module, "kernels", None) or {}).get(name, "reference")
    if kind == "native" and x.device.type == "cpu":
        return _native(module, name, x, bias)
    if kind == "int4" and x.device.type == "cpu":
        # the hot path (a decode step runs ~200 of these): only the ops the kernel needs, no dispatch layers
        bufs = module._buffers  # the dict itself: nn.Module.__getattr__ costs ~1 us a lookup, 2x per call
        packed, sz = bufs[name + "_int4"], bufs[name + "_int4_sz"]
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        m, k = x2.shape
        parts = packed.shape[1] * 2 // k  # parts side by side along K: x repeated that often sums them in one call
        if m <= INT4_MAX_ROWS or not int4pack.can_unpack():
            xb = x2.to(torch.bfloat16).contiguous()
            if parts > 1:
                xb = xb.repeat(1, parts)
            y = _INT4_MM(xb, packed, xb.shape[1] // sz.shape[0], sz).to(x.dtype)
        else:
            y = _large_m(x2, packed, sz, parts)
        if bias is not None:
            y = y + bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])
    if kind == "dense":
        w = module._buffers[name + "_dense"]
        if x.dtype == torch.float32:
            return F.linear(x, w, bias)
        y = F.linear(x.float(), w)  # float32 product (exact weights), then the activation dtype
        return (y if bias is None else y + bias.float()).to(x.dtype)
    if kind == "triton":
        blocks = getattr(module, f"{name}_blocks")
        if x.device == blocks.device and (x.device.type == "cuda" or triton_kernels.interpreted()) and \
                triton_kernels.enabled():
            qtype, shape = module.packed[name]
            try:
                return triton_kernels.matmul(x, blocks, qtype, shape, bias)
            except Exception as e:  # noqa: BLE001 - a kernel that cannot compile/launch here: never fail a forward
                triton_kernels.disable(f"{type(e).__name__}: {e}")
        return packed_linear(module, name, x, bias)  # off the GPU, or kernels disabled: the bit-exact path
    if kind in ("reference", "native") or (kind == "q8_0" and x.device.type != "cpu"):
        return packed_linear(module, name, x, bias)
    qtype, shape = module.packed[name]
    x2 = x.reshape(-1, shape[1])
    if kind == "int4":  # off the CPU: the bf16 dequantization, chunk by chunk
        packed, sz = getattr(module, f"{name}_int4"), getattr(module, f"{name}_int4_sz")
        n = len(int4pack.parts_of(qtype))
        xk = x2 if n == 1 else x2.repeat(1, n)
        y = int4pack.matmul_dequantized(xk, packed, sz, (shape[0], n * shape[1]), CHUNK_ELEMS)
    elif kind == "buffer":
        y = F.linear(x2, _decoded(getattr(module, f"{name}_blocks"), qtype, shape, x.dtype))
    else:
        y = _chunked(x2, shape, _q8_0_decoder(getattr(module, f"{name}_blocks"), shape, x.dtype))
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], shape[0])


def native_q8x() -> bool:
    """Whether Q4_0 / Q4_1 / Q8_0 decode GEMVs take the int8-activation kernel (llama.cpp's arithmetic,
    approximate; see native_linear.gemv_q8x): where the build has it, unless ``$INFERFLOW_NATIVE_Q8X=0``."""
    return os.environ.get("INFERFLOW_NATIVE_Q8X", "1") != "0" and native_linear.has_vnni()


def q8x_takes(qtype: int, shape: tuple[int, int]) -> bool:
    """Whether a native linear of ``qtype`` runs :func:`native_q8x`'s kernel at decode (vocab heads too, as in
    llama.cpp: the greedy answers of tests/test_default_model.py hold)."""
    del shape  # every shape: the kernel takes any N and K % 32 == 0 (ggml rows are whole blocks)
    return qtype in native_linear.Q8X_TYPES and native_q8x()


def _native(module: torch.nn.Module, name: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The native kernel's ``x @ W^T + b`` (float32 product, cast back to ``x.dtype``): the kernel for up to
    :data:`NATIVE_MAX_ROWS` rows, else the weight decoded once (bit-identical) into a reused float32 buffer, a
    few MiB of rows at a time, each slab multiplied at once by one float32 GEMM."""
    blocks = module._buffers[name + "_blocks"]
    qtype, shape = module.packed[name]
    x2 = x if x.dim() == 2 else x.reshape(-1, shape[1])
    if x2.shape[0] <= NATIVE_MAX_ROWS:
        y = (native_linear.gemv_q8x if q8x_takes(qtype, shape) else native_linear.gemv)(blocks, qtype, shape, x2, bias)
    else:
        rows, cols = shape
        step = max(1, NATIVE_DECODE_ELEMS // cols)
        b = None if bias is None else bias.float()
        if NATIVE_PREFILL_BF16 and rows < Q8_INT4_MAX_N:  # not vocab heads: their logits stay exact
            xs, decode, buf = x2.to(torch.bfloat16), native_linear.dequantize_bf16, _bf16_buffer
        else:
            xs, decode, buf = x2.float(), native_linear.dequantize, _buffer
        if rows <= step:
            y = F.linear(xs, decode(blocks, qtype, shape, buf(rows * cols, blocks.device))).float()
            if b is not None:
                y += b
        else:
            y = torch.empty(x2.shape[0], rows, dtype=torch.float32)
            for r in range(0, rows, step):
                n = min(step, rows - r)
                w = decode(blocks[r:r + n], qtype, (n, cols), buf(n * cols, blocks.device))
                y[:, r:r + n] = F.linear(xs, w.view(n, cols))
            if b is not None:
                y += b
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], shape[0])


_INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default if int4pack.available() else None
_tlocal = threading.local()  # one reused bf16 [K, N] buffer per thread for the large-M path


def _large_m(x2: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor, parts: int) -> torch.Tensor:
    """``x2 @ W^T`` for many rows (prefill): W^T decoded once per call into a reused bf16 buffer
    (int4pack.dequantize_t), then one bf16 GEMM; where the layout has no transposed decoder, the older
    chunked decode (int4pack.matmul_dequantized)."""
    rows, cols = packed.shape[0], packed.shape[1] * 2
    xb = x2.to(torch.bfloat16)
    if parts > 1:
        xb = xb.repeat(1, parts)
    if not int4pack.can_transpose(rows):
        return int4pack.matmul_dequantized(xb, packed, sz, (rows, cols), CHUNK_ELEMS).to(x2.dtype)
    buf = getattr(_tlocal, "buf", None)
    if buf is None or buf.numel() < rows * cols:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode alike
            buf = _tlocal.buf = torch.empty(rows * cols, dtype=torch.bfloat16)
    wt = int4pack.dequantize_t(packed, sz, (rows, cols), buf[:rows * cols].view(cols, rows))
    return torch.mm(xb.contiguous(), wt).to(x2.dtype)


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


def _bf16_buffer(numel: int, device: torch.device) -> torch.Tensor:
    """This thread's reused bf16 buffer for the native large-batch path's decoded weight."""
    buf = getattr(_local, "bbuf", None)
    if buf is None or buf.numel() < numel or buf.device != device:
        with torch.inference_mode(False):
            buf = _local.bbuf = torch.empty(numel, dtype=torch.bfloat16, device=device)
    return buf[:numel]


def _buffer(numel: int, device: torch.device) -> torch.Tensor:
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < numel or buf.device != device:
        with torch.inference_mode(False):  # a normal tensor: writable in and out of inference mode alike
            buf = _local.buf = torch.empty(max(numel, CHUNK_ELEMS), dtype=torch.float32, device=device)
    return buf[:numel]


# Block types decoded whole into a reused per-thread buffer, then one matmul (the issue's "dequantize one layer
# at a time into a reused buffer"): inferflow's q3.5, whose non-uniform levels no int4 mapping can express.
# Filled by inferflow.quant.formats at import.
BUFFERED: set[int] = set()
_wlocal = threading.local()


def _decoded(blocks: torch.Tensor, qtype: int, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The weight decoded into this thread's buffer for (shape, dtype): every linear of that shape reuses it, so a
    decode step allocates nothing; the decoder writes float32 (exact) and is cast once when dtype differs."""
    key = (tuple(shape), dtype, blocks.device)
    bufs = getattr(_wlocal, "bufs", None)
    if bufs is None:
        bufs = _wlocal.bufs = {}
    buf = bufs.get(key)
    if buf is None:
        with torch.inference_mode(False):
            buf = bufs[key] = torch.empty(shape, dtype=dtype, device=blocks.device)
    w = ggml.dequantize(blocks, qtype, shape, torch.float32)
    if dtype == torch.float32:
        return w  # already a fresh float32 tensor: a copy into the buffer would only add a pass
    return buf.copy_(w)


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

