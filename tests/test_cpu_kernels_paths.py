"""The CPU fast paths picked by batch rows and by shape (inferflow/quant/cpu_kernels.py): the large-M path's
transposed int4 decode (int4pack.dequantize_t) and the float32-held vocab head ("dense"), against the reference
dequantization."""
import gguf
import pytest
import torch
import torch.nn.functional as F

from test_cpu_kernels import held_linear
from inferflow.quant import cpu_kernels, int4pack
from inferflow.registry import create

pytestmark = pytest.mark.usefixtures("no_native")  # the torch paths (native kernels: tests/test_native_quant.py)

Q = gguf.GGMLQuantizationType
BF16_TOL = 1.5e-2  # as tests/test_cpu_kernels.py: bf16 activations, scales and output


def held(qtype, rows: int, cols: int, kernels: str = "fast", bias: bool = False):
    return held_linear(qtype, rows, cols, kernels, bias, seed=int(qtype))


def rel_err(y, ref) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


needs_t = pytest.mark.skipif(not int4pack.available() or not int4pack.can_transpose(128),
                             reason="no int4 kernel / transposed decoder on this build")


@needs_t
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_dequantize_t_is_the_kernels_weight_transposed(qtype):
    lin, _ = held(qtype, 128, 256)
    packed, sz = lin.weight_int4, lin.weight_int4_sz
    rows, cols = packed.shape[0], packed.shape[1] * 2  # Q8_0: two parts side by side along K
    want = int4pack.dequantize(packed, sz, (rows, cols), torch.float32)
    got = int4pack.dequantize_t(packed, sz, (rows, cols), torch.empty(cols, rows, dtype=torch.bfloat16))
    # the same codes and affine, rounded once to bf16 (zero - 8 scale rounded too: one more bf16 step at most)
    assert (got.t().float() - want).abs().max() <= 2 ** -7 * want.abs().max()


@needs_t
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0], ids=lambda q: q.name)
def test_large_batch_path_matches_exact_dequant(qtype):
    lin, w = held(qtype, 192, 256, bias=True)
    assert lin.kernels["weight"] == "int4"
    torch.manual_seed(0)
    for m in (cpu_kernels.INT4_MAX_ROWS + 1, 160):
        x = torch.randn(m, 256)
        ref = F.linear(x, w, lin.bias)
        y = lin(x)
        assert y.shape == ref.shape and y.dtype == torch.float32
        assert rel_err(y, ref) <= BF16_TOL, (m, rel_err(y, ref))
    x = torch.randn(2, 80, 256)  # a 3-D input keeps its shape
    assert lin(x).shape == (2, 80, 192)


@needs_t
def test_large_batch_path_for_inferflow_formats():
    from inferflow.quant import formats

    w = torch.randn(128, 256) * 0.02
    for name in ("q4", "q8", "q6"):
        p = formats.quantize(w, name)
        lin = create("linear", {"in_features": 256, "out_features": 128, "bias": False})
        with cpu_kernels.using("fast"):
            lin.load_packed("weight", p, torch.float32)
        if lin.kernels["weight"] != "int4":
            continue
        x = torch.randn(cpu_kernels.INT4_MAX_ROWS + 5, 256)
        assert rel_err(lin(x), F.linear(x, p.dequantize())) <= BF16_TOL, name


def test_vocab_head_is_held_exact_in_float32(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "Q8_INT4_MAX_N", 64)  # a 96-row Q8_0 weight counts as a vocab head
    fast, w = held(Q.Q8_0, 96, 128)
    ref, _ = held(Q.Q8_0, 96, 128, "reference")
    assert fast.kernels["weight"] == "dense" and torch.equal(fast.weight_dense, w)
    for m in (1, 3):
        x = torch.randn(m, 128)
        assert torch.equal(fast(x), ref(x))  # the same float32 weights, one F.linear each: bit for bit
    xb = torch.randn(2, 128).bfloat16()
    y = fast(xb)
    assert y.dtype == torch.bfloat16 and rel_err(y, F.linear(xb.float(), w)) < 1e-2
    monkeypatch.setattr(cpu_kernels, "DENSE_MAX_ELEMS", 96 * 128 - 1)  # too large to hold in float32: blocks
    big, _ = held(Q.Q8_0, 96, 128)
    assert big.kernels["weight"] == "q8_0"
    x = torch.randn(1, 128)
    assert torch.equal(big(x), ref(x))


@pytest.mark.skipif(not int4pack.available(), reason="no int4 kernel on this build")
def test_fused_int4_parts_give_the_parts_outputs():
    from inferflow.model.fuse import fuse_linears

    parts = [held(q, rows, 256, bias=True)[0] for q, rows in ((Q.Q4_0, 128), (Q.Q4_0, 64), (Q.Q4_0, 64))]
    x = torch.randn(3, 256)
    want = [p(x) for p in parts]
    fused = fuse_linears(parts)
    assert fused is not None and fused.kernels["weight"] == "int4"
    # the kernel computes every output row on its own: the fused call is the parts' outputs bit for bit
    assert torch.equal(fused(x), torch.cat(want, -1))
    assert all(torch.equal(p(x), w) for p, w in zip(parts, want))  # parts now view the fused codes
    assert parts[0].weight_int4.data_ptr() == fused.weight_int4.data_ptr()
    xl = torch.randn(cpu_kernels.INT4_MAX_ROWS + 4, 256)  # the large-M path reads the fused codes too
    ref = torch.cat([F.linear(xl, held(q, r, 256)[1]) for q, r in ((Q.Q4_0, 128), (Q.Q4_0, 64), (Q.Q4_0, 64))], -1)
    assert rel_err(fused(xl) - fused.bias, ref) <= BF16_TOL
    odd = [held(Q.Q4_0, 48, 256)[0], held(Q.Q4_0, 64, 256)[0]]  # 48 rows: not whole row blocks of every layout
    assert fuse_linears(odd) is None
    mixed = [held(Q.Q4_0, 64, 256)[0], held(Q.Q8_0, 64, 256)[0]]  # block types differ
    assert fuse_linears(mixed) is None
