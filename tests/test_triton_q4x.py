"""The 4-bit GEMV on int8 activations (inferflow/quant/triton_q4x.py) on a CPU under TRITON_INTERPRET=1, where
``dp4a`` is summed byte by byte: it computes llama.cpp's arithmetic (activations quantized per 32-column block,
exact integer block sums, one scale per block) for q4 (q4c) and q4_0, with bias, odd N, a tail of blocks, 1-2 rows
and split-K, and stays close to the float matmul. Decode-sized calls take it by default; $INFERFLOW_TRITON_Q8X=0
keeps the float32 GEMV."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are built (lazily, at first use)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from inferflow.quant import formats, triton_kernels, triton_soa  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "triton_interpreter")
NAMES = ("q4", "q4_0")
CPU = torch.device("cpu")


def _weight(name: str, n: int, k: int, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[:, :32] *= 4  # blocks of different scales
    return formats.quantize(w, name)


def _reference(x: torch.Tensor, p, bias: torch.Tensor | None = None) -> torch.Tensor:
    """llama.cpp's q4 x q8 arithmetic in float64 from the blocks: x rounded per 32-block to int8 codes."""
    n, k = p.shape
    nb, m = k // 32, x.shape[0]
    xb = x.float().reshape(m, nb, 32)
    amax = xb.abs().amax(-1)
    dx = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    qx = torch.floor(xb * inv[..., None] + 0.5).double()
    sx = qx.sum(-1) * dx.double()
    blocks = p.data.reshape(n, nb, 18)
    nib = blocks[:, :, 2:]
    q = torch.cat([nib & 15, nib >> 4], dim=-1).double()  # [N, nb, 32] in column order
    if triton_kernels._KIND_OF[p.qtype] == "q4_0":
        a = blocks[:, :, :2].contiguous().view(torch.float16).reshape(n, nb).double()
        off = torch.full_like(a, 8.0)
    else:
        a = triton_kernels._scale_table(CPU)[blocks[:, :, 0].long()].double()
        off = blocks[:, :, 1].double() / 16.0
    si = torch.einsum("nbj,mbj->mnb", q, qx)
    y = (a[None] * (dx.double()[:, None, :] * si - off[None] * sx[:, None, :])).sum(-1)
    return (y + bias.double() if bias is not None else y).float()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_llama_cpp_arithmetic(monkeypatch, name, m, dtype):
    monkeypatch.setenv("INFERFLOW_TRITON_Q8X", "1")
    n, k = 45, 96  # odd N; 3 blocks: a tail past the interpreter's 2-block tile
    p = _weight(name, n, k)
    g = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, generator=g)
    y = triton_kernels.matmul(x, p.data, p.qtype, p.shape, bias)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = _reference(x, p, bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # float16 outputs: their own rounding
    assert (y.float() - ref).abs().max() <= tol * ref.abs().max()
    exact = F.linear(x.float(), p.dequantize(), bias)  # int8 activations: ~1/254 of a block's largest, per block
    assert (y.float() - exact).abs().max() <= 0.02 * exact.abs().max()
    assert (y.float() - exact).abs().max() > 1e-6 * exact.abs().max()  # it is not the float path


@pytest.mark.parametrize("name", NAMES)
def test_switch_keeps_the_float_gemv(monkeypatch, name):
    p = _weight(name, 21, 64, seed=5)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(6))
    monkeypatch.setenv("INFERFLOW_TRITON_Q8X", "0")
    y = triton_kernels.matmul(x, p.data, p.qtype, p.shape)
    ref = F.linear(x, p.dequantize())
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_zero_blocks_and_zero_rows(monkeypatch):
    """A block of x that is all zeros has no scale (absmax 0): it adds nothing, and no NaN appears."""
    monkeypatch.setenv("INFERFLOW_TRITON_Q8X", "1")
    p = _weight("q4_0", 19, 128, seed=2)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(3))
    x[0, 32:64] = 0
    x[1] = 0
    y = triton_kernels.matmul(x, p.data, p.qtype, p.shape)
    assert torch.isfinite(y).all() and not y[1].any()
    assert (y - _reference(x, p)).abs().max() <= 1e-5 * y.abs().max()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("split,m", [(3, 1), (2, 2)])
def test_split_k(name, split, m):
    """Split-K (partials summed by the tile's last program, counters reset after) over 32 blocks in tiles of 2:
    splits of 12, 12 and 8 blocks (3) or 16 and 16 (2), odd N, twice: the counters are reusable."""
    from inferflow.quant import triton_q4x

    n, k = 21, 1024
    p = _weight(name, n, k, seed=7)
    w16 = p.data.reshape(n, -1).view(torch.int16)
    ws, cnt = triton_soa._split_buffers(CPU)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8))
    xq, xs = torch.empty(m, k // 4, dtype=torch.int32), torch.empty(m, 2, k // 32)
    triton_q4x.quant_x8[(16, m)](x, xq, xs, k, x.stride(0), BB=2)
    ref = _reference(x, p)
    for _ in range(2):
        y = torch.empty(m, n)
        triton_q4x.gemv4x.fn[(3, split)](xq, xs, w16, w16, triton_kernels._scale_table(CPU), y, y, ws, cnt, n, k,
                                         w16.stride(0), y.stride(0), HAS_BIAS=False, SOA=False,
                                         KIND=triton_soa._CODE[triton_kernels._KIND_OF[p.qtype]], MP=m, INTERP=True,
                                         BLOCK_N=8, BB=2, SPLIT=split)
        assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
        assert int(cnt.abs().sum()) == 0
