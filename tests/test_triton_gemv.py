"""The structure-of-arrays quantized matmul (inferflow/quant/triton_soa.py, kernels in triton_gemv.py) on a CPU under
TRITON_INTERPRET=1: the repacking keeps every bit (same bytes per weight, bit-identical decode), and the GEMV
(1-2 rows: float32 FMA; 3-16 rows: tl.dot) and prefill (dequantize + matmul) paths match F.linear with the
torch-dequantized weight for q4 (q4c), q4_0 and q8_0, with bias, an odd N and a K tail shorter than a tile."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are built (lazily, at first use)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from inferflow.quant import formats, triton_kernels, triton_soa  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "triton_interpreter")
NAMES = ("q4", "q4_0", "q8_0")
N, K = 45, 96  # odd N; K = 1.5 interpreter tiles (64)


@pytest.fixture(scope="module")
def weights():
    out = {}
    for i, name in enumerate(NAMES):
        w = torch.randn(N, K, generator=torch.Generator().manual_seed(i))
        w[:, :32] *= 4  # blocks of different scales
        out[name] = formats.quantize(w, name)
    return out


def _kind(p) -> str:
    return triton_kernels._KIND_OF[p.qtype]


@pytest.mark.parametrize("name", NAMES)
def test_repack_keeps_bits_and_is_cached(weights, name):
    p = weights[name]
    codes, scales = triton_soa.soa(p.data, _kind(p), p.shape)
    pad = 1 if name == "q8_0" else 256 / 96  # 4-bit rows are padded to whole 256-column groups
    assert codes.nbytes + scales.nbytes == p.data.nbytes * pad  # 4.5 / 8.5 bits per weight, as the blocks
    assert triton_soa.soa(p.data, _kind(p), p.shape)[0] is codes  # repacked once per blocks tensor
    w = triton_soa.dequantize(codes, scales, triton_kernels._scale_table(torch.device("cpu")), _kind(p), p.shape,
                              torch.float32, True)
    assert torch.equal(w, p.dequantize())  # bit-identical decode


@pytest.mark.parametrize("name", NAMES)
# q8_0: FMA GEMV, tl.dot GEMV, decode + cuBLAS; 4-bit: FMA GEMV, swapped GEMM (3-32 rows), GEMM
@pytest.mark.parametrize("m", [1, 2, 3, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matmul_matches_torch(weights, name, m, dtype):
    p = weights[name]
    g = torch.Generator().manual_seed(m)
    x, bias = torch.randn(m, K, generator=g), torch.randn(N, generator=g)
    ref = F.linear(x.to(dtype).float(), p.dequantize(), bias)
    y = triton_kernels.matmul(x.to(dtype), p.data, p.qtype, p.shape, bias)
    assert y.shape == (m, N) and y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert (y.float() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("name", ["q8_0"])
def test_elementwise_accumulation_variant(weights, name):
    """The GEMV's other autotune variant (BLOCKSUM=False: one reduction after the loop; no prefetch), 2 rows."""
    from inferflow.quant import triton_gemv

    p = weights[name]
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(5))
    codes, scales = triton_soa.soa(p.data, _kind(p), p.shape)
    y = torch.empty(2, N)
    triton_gemv.gemv_fma.fn[(3,)](x, codes, scales, triton_kernels._scale_table(torch.device("cpu")), y, y, 2, N, K,
                                  x.stride(0), y.stride(0), HAS_BIAS=False, KIND=triton_soa._CODE[_kind(p)], MP=2,
                                  BLOCK_N=16, BLOCK_K=64, BLOCKSUM=False,
                                  PREFETCH=False)
    ref = F.linear(x, p.dequantize())
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_cache_follows_the_blocks_tensor(weights):
    p = weights["q4"]
    blocks = p.data.clone()
    key = triton_soa._key(blocks, "q4c", p.shape, triton_soa.repack)
    triton_soa.soa(blocks, "q4c", p.shape)
    assert key in triton_soa._cache
    del blocks  # the repacking goes with its blocks
    assert key not in triton_soa._cache


@pytest.mark.parametrize("name", ["q4_0", "q8_0"])
def test_prefill_in_row_chunks(weights, monkeypatch, name):
    """A weight above DEQUANT_MAX_ELEMS (a vocabulary head) is decoded and multiplied in row chunks (4-bit: past
    GEMM_MAX_ROWS rows, here lowered to 8)."""
    p = weights[name]
    monkeypatch.setattr(triton_soa, "DEQUANT_MAX_ELEMS", 20 * K)  # 45 rows: chunks of 20, 20, 5
    monkeypatch.setattr(triton_soa, "GEMM_MAX_ROWS", 8)
    x, bias = torch.randn(19, K, generator=torch.Generator().manual_seed(9)), torch.randn(N)
    y = triton_kernels.matmul(x, p.data, p.qtype, p.shape, bias)
    ref = F.linear(x, p.dequantize(), bias)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("name", ["q4", "q4_0"])
@pytest.mark.parametrize("split,prefetch,m", [(3, True, 1), (2, False, 2)])
def test_gemv4_split_k(name, split, prefetch, m):
    """The 4-bit GEMV's split-K variant (partials summed by the tile's last program, counters reset after) over
    K = 1024 (4 groups: splits of 2, 2, 0 groups) with odd N, twice: the counters are reusable."""
    from inferflow.quant import triton_q4

    n, k = 21, 1024
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    p = formats.quantize(w, name)
    codes, scales = triton_soa.soa(p.data, _kind(p), p.shape)
    ws, cnt = triton_soa._split_buffers(torch.device("cpu"))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4))
    ref = F.linear(x, p.dequantize())
    for _ in range(2):
        y = torch.empty(m, n)
        triton_q4.gemv4.fn[(3, split)](x, codes, scales, triton_kernels._scale_table(torch.device("cpu")), y, y, ws,
                                       cnt, n, k, codes.shape[1], x.stride(0), y.stride(0), HAS_BIAS=False,
                                       KIND=triton_soa._CODE[_kind(p)], MP=m, BLOCK_N=8, BG=1, PREFETCH=prefetch,
                                       SPLIT=split)
        assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
        assert int(cnt.abs().sum()) == 0


@pytest.mark.parametrize("name", ["q4", "q4_0"])
def test_gemm4_slab_variant(name):
    """The 4-bit GEMM's other autotune variant (WHOLE=False: one dot per nibble slab), 2 groups a step, K tail."""
    from inferflow.quant import triton_q4_gemm as triton_q4

    n, k, m = 21, 800, 5
    p = formats.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(5)), name)
    codes, scales = triton_soa.soa(p.data, _kind(p), p.shape)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6))
    y = torch.empty(m, n)
    triton_q4.gemm4.fn[(2, 1)](x, codes, scales, triton_kernels._scale_table(torch.device("cpu")), y, y, m, n, k,
                               codes.shape[1], x.stride(0), y.stride(0), 8, HAS_BIAS=False,
                               KIND=triton_soa._CODE[_kind(p)], IEEE=True, BLOCK_M=16, BLOCK_N=16, BG=2, WHOLE=False)
    ref = F.linear(x, p.dequantize())
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize("name", ["q4", "q4_0"])
@pytest.mark.parametrize("split,m", [(1, 20), (3, 19), (2, 70)])
def test_gemm4_swapped(name, split, m):
    """The swapped 4-bit GEMM (y^T = W x^T, activations as B) over a K tail
    (K = 800: 4 groups, the last partial), odd N, several row tiles (70 rows: 64 + 6) and split K (3 splits of 2,
    2 and 0 groups), twice: the split counters are reusable."""
    from inferflow.quant import triton_q4_swap as t4s

    n, k = 21, 800
    p = formats.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(7)), name)
    codes, scales = triton_soa.soa(p.data, _kind(p), p.shape)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8))
    bias = torch.randn(n)
    ws, cnt = t4s._split_buffers(torch.device("cpu"))
    ref = F.linear(x, p.dequantize(), bias)
    bm = t4s.tile_rows(m)
    for _ in range(2):
        y = torch.empty(m, n)
        t4s._gemm4s[(2, -(-m // bm), split)](
            x, codes, scales, triton_kernels._scale_table(torch.device("cpu")), bias, y, ws, cnt, m, n, k,
            codes.shape[1], x.stride(0), y.stride(0), 1 << (m - 1).bit_length(), HAS_BIAS=True,
            KIND=triton_soa._CODE[_kind(p)], IEEE=True, BLOCK_M=bm, BLOCK_N=16, SPLIT=split, EVEN=False)
        assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
        assert int(cnt.abs().sum()) == 0


@pytest.mark.parametrize("n,kw,mb", [(151936, 128, 16), (4096, 32, 32)])
def test_gemm4_swapped_prune_never_splits_past_the_workspace(n, kw, mb):
    """A shape whose partials overflow the split-K workspace (a vocab-wide head at 16 rows), or whose K has a
    single group, is never given a split config, even by a list of split ones only."""
    import triton

    from inferflow.quant import triton_q4_swap as t4s

    split_only = [triton.Config({"BLOCK_N": 64, "SPLIT": 2}, num_warps=4, num_stages=3)]
    kept = t4s._prune(split_only, {"N": n, "KW": kw, "MB": mb})
    assert [(c.kwargs["SPLIT"], c.kwargs["BLOCK_N"], c.num_stages) for c in kept] == [(1, 64, 3)]
    assert not t4s._fits(2, t4s.MAX_TILE_ROWS, n, kw // 32, mb)
    assert all(c.kwargs["SPLIT"] == 1 for c in t4s.gemm4s_whole.configs)


def test_gemm4_swapped_unsplit_where_no_split_fits(monkeypatch):
    """matmul sends a shape whose partials the workspace cannot hold to the unsplit kernel (Triton skips pruning
    for a one-config list, so pruning alone would run the split one and write past the workspace): the workspace
    stays untouched and the product is right."""
    from inferflow.quant import triton_q4_swap as t4s

    n, k = 21, 1024  # 4 groups: a split of 2 fits the real workspace
    p = formats.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(7)), "q4_0")
    codes, scales = triton_soa.soa(p.data, _kind(p), p.shape)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(9))
    ws, _ = t4s._split_buffers(torch.device("cpu"))
    ws[:4096] = float("nan")
    assert t4s._fits(2, t4s.MAX_TILE_ROWS, n, 4, 32)
    monkeypatch.setattr(t4s, "SPLIT_WS_FLOATS", 64)  # 2 splits x 32 rows x 21 outputs no longer fit
    y = t4s.matmul(x, codes, scales, triton_kernels._scale_table(torch.device("cpu")), triton_soa._CODE["q4_0"],
                   n, k, None, torch.empty(20, n), True)
    ref = F.linear(x, p.dequantize())
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert bool(ws[:4096].isnan().all())
