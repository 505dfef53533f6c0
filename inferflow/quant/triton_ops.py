"""The Triton kernels of :mod:`inferflow.quant.triton_kernels` (layouts and numerics are documented there).

A module of its own because ``@triton.jit`` functions must be module globals, and importing triton (and choosing
the interpreter, TRITON_INTERPRET=1) should only happen when a quantized weight first runs on this path.
"""
import triton
import triton.language as tl


@triton.jit
def add(a, b):
    # tl.sum's own combine function is jit-decorated when triton is first imported: if that happened before
    # TRITON_INTERPRET=1 was set (another library imported triton), the interpreter cannot call it; ours is
    # decorated with this module, at first use
    return a + b


@triton.jit
def f16_at(p, mask):
    lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def decode(w_ptr, tab_ptr, rn, rk, row_bytes, mask, KIND: tl.constexpr, BB: tl.constexpr):
    """Weights [len(rn), len(rk)] (float32) of rows rn, columns rk, decoded from their blocks."""
    j = rk % 32
    base = w_ptr + rn[:, None].to(tl.int64) * row_bytes + ((rk // 32) * BB)[None, :]
    if KIND == 1:  # q8_0: d * q
        d = f16_at(base, mask)
        q = tl.load(base + 2 + j[None, :], mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        w = q * d
    else:
        byte = tl.load(base + 2 + (j % 16)[None, :], mask=mask, other=0).to(tl.int32)
        q = ((byte >> (4 * (j // 16))[None, :]) & 15).to(tl.float32)
        if KIND == 0:  # q4c: s * (q - zc / 16)
            c = tl.load(base, mask=mask, other=0).to(tl.int32)
            s = tl.load(tab_ptr + c, mask=mask, other=0.0)
            z = tl.load(base + 1, mask=mask, other=0).to(tl.float32) / 16.0
            w = (q - z) * s
        else:  # q4_0: d * (q - 8)
            d = f16_at(base, mask)
            w = (q - 8.0) * d
    return w


@triton.jit
def gemv(x_ptr, w_ptr, tab_ptr, b_ptr, y_ptr, N, K, row_bytes, sxm, sym, HAS_BIAS: tl.constexpr,
         KIND: tl.constexpr, BB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, m = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    acc = tl.full([BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        w = decode(w_ptr, tab_ptr, rn, rk, row_bytes, nmask[:, None] & kmask[None, :], KIND, BB)
        x = tl.load(x_ptr + m * sxm + rk, mask=kmask, other=0.0).to(tl.float32)
        acc += tl.reduce(w * x[None, :], 1, add)  # = tl.sum; see add()
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * sym + rn, acc.to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def gemm(x_ptr, w_ptr, tab_ptr, b_ptr, y_ptr, M, N, K, row_bytes, sxm, sym, HAS_BIAS: tl.constexpr,
         KIND: tl.constexpr, BB: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = rm < M, rn < N
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)  # tl.zeros is jit-decorated: see add()
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        kmask = rk < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * sxm + rk[None, :], mask=mmask[:, None] & kmask[None, :],
                    other=0.0)
        w = decode(w_ptr, tab_ptr, rn, rk, row_bytes, nmask[:, None] & kmask[None, :], KIND, BB)
        if IEEE:  # float32 activations; also the interpreter's path (its bf16 tl.dot is wrong: triton 3.9)
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])
