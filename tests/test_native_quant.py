"""Native ggml block kernels (inferflow/native/gemv_ggml.c via inferflow/quant/native_linear.py, kernel kind
"native" in inferflow/quant/cpu_kernels.py) against the bit-exact reference dequantization + a float64 matmul;
bitwise invariance to the row count and the thread count; a tiny GGUF model's greedy tokens with the kernels on
and off."""
import gguf
import pytest
import torch
import torch.nn.functional as F

import inferflow
from gguf_files import random_blocks, write_llama
from inferflow.model.fuse import fuse_projections
from inferflow.quant import PackedTensor, cpu_kernels, ggml, native_linear
from inferflow.registry import create

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K]
EXACT_TOL = 2e-6  # float32 summation order only (measured ~1e-7 .. 3e-7)
Q8X_TOL = 2e-2  # int8 activations (llama.cpp's arithmetic; measured 5e-3 .. 7e-3)
BF16_TOL = 1.5e-2  # large batches: bf16 weights, activations and output (as tests/test_cpu_kernels.py)

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not native_linear.available(), reason="native kernels unavailable here")]


def _case(qtype: Q, rows: int = 37):
    cols = 512 if qtype in (Q.Q4_K, Q.Q6_K) else 96  # whole blocks (256 for the k-quants)
    blocks = random_blocks(qtype, rows, cols, seed=int(qtype))
    return blocks, (rows, cols), ggml.dequantize(blocks, int(qtype), (rows, cols))


def _err(y: torch.Tensor, exact: torch.Tensor) -> float:
    return ((y.double() - exact).abs().max() / exact.abs().max()).item()


@pytest.fixture(params=[True, False], ids=["avx512", "portable"])
def simd(request):
    if request.param and not native_linear.has_simd():
        pytest.skip("no AVX-512 build")
    native_linear.set_simd(request.param)
    yield request.param
    native_linear.set_simd(True)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_matches_exact_product(qtype, simd):
    blocks, shape, w = _case(qtype)
    # the decoded weights are the reference's bit for bit
    assert torch.equal(native_linear.dequantize(blocks, int(qtype), shape), w)
    torch.manual_seed(0)
    bias = torch.randn(shape[0])
    for m in (1, 2, 5, 8, 16):
        x = torch.randn(m, shape[1])
        exact = x.double() @ w.double().T + bias.double()
        y = native_linear.gemv(blocks, int(qtype), shape, x, bias)
        assert y.shape == (m, shape[0]) and y.dtype == torch.float32
        assert _err(y, exact) <= EXACT_TOL, (m, _err(y, exact))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_rows_and_threads_do_not_change_bits(qtype, simd):
    blocks, shape, _ = _case(qtype, rows=45)
    x = torch.randn(16, shape[1])
    whole = native_linear.gemv(blocks, int(qtype), shape, x)
    for m in (1, 3, 5):
        parts = torch.cat([native_linear.gemv(blocks, int(qtype), shape, x[i:i + m]) for i in range(0, 16, m)])
        assert torch.equal(parts, whole), m
    torch.set_num_threads(2)  # restored by the one_thread fixture
    native_linear.set_grain(64)  # this small weight split between both threads too
    try:
        assert torch.equal(native_linear.gemv(blocks, int(qtype), shape, x), whole)
    finally:
        native_linear.set_grain(1 << 19)
    # a row-sliced view of fused blocks (q/k/v, gate/up) reads the same rows
    assert torch.equal(native_linear.gemv(blocks[8:20], int(qtype), (12, shape[1]), x), whole[:, 8:20])


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_int8_activation_kernel(qtype):
    if not native_linear.has_vnni():
        pytest.skip("no AVX512-VNNI build")
    blocks, shape, w = _case(qtype)
    x = torch.randn(16, shape[1])
    exact = x.double() @ w.double().T
    y = native_linear.gemv_q8x(blocks, int(qtype), shape, x)
    assert _err(y, exact) <= Q8X_TOL
    one = torch.cat([native_linear.gemv_q8x(blocks, int(qtype), shape, x[i:i + 1]) for i in range(16)])
    assert torch.equal(one, y)
    for m in (3, 5, 6, 7, 9, 13):  # a tile per M up to 8, then 8 at a time: every M gives each row the same bits
        assert torch.equal(native_linear.gemv_q8x(blocks, int(qtype), shape, x[:m]), y[:m]), m
    # rows 32..36 are a tail (16 rows at a time otherwise): a shifted slice puts them in a 16-row group, same bits
    assert torch.equal(native_linear.gemv_q8x(blocks[5:], int(qtype), (32, shape[1]), x), y[:, 5:])
    torch.set_num_threads(2)  # restored by the one_thread fixture
    native_linear.set_grain(64)
    try:
        assert torch.equal(native_linear.gemv_q8x(blocks, int(qtype), shape, x), y)
    finally:
        native_linear.set_grain(1 << 19)


def _linear(qtype: Q, kernels: str = "fast", bias: bool = True):
    blocks, shape, w = _case(qtype, rows=40)
    lin = create("linear", {"in_features": shape[1], "out_features": shape[0], "bias": bias})
    if bias:
        lin.bias = torch.nn.Parameter(torch.randn(shape[0]), requires_grad=False)
    with cpu_kernels.using(kernels):
        assert lin.load_packed("weight", PackedTensor(blocks, int(qtype), shape), torch.float32)
    return lin, w


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_held_linear_runs_native_small_and_large_batches(qtype, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "INT4_OVER_NATIVE", frozenset())  # Q4_K too (else the int4 kernel's)
    lin, w = _linear(qtype)
    assert lin.kernels["weight"] == "native" and lin.weight_blocks.dtype == torch.uint8  # blocks kept as-is
    q8x = cpu_kernels.q8x_takes(int(qtype), w.shape)  # llama.cpp's int8 activations: the default for its types
    assert q8x == (qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0) and native_linear.has_vnni())
    for m in (1, 7, cpu_kernels.NATIVE_MAX_ROWS + 5):  # above NATIVE_MAX_ROWS: decode + one GEMM
        x = torch.randn(m, w.shape[1])
        exact = x.double() @ w.double().T + lin.bias.double()
        large = m > cpu_kernels.NATIVE_MAX_ROWS
        tol = BF16_TOL if large and cpu_kernels.NATIVE_PREFILL_BF16 else Q8X_TOL if q8x and not large else EXACT_TOL
        assert _err(lin(x), exact) <= tol, m
        if q8x and not large:  # $INFERFLOW_NATIVE_Q8X=0: the exact decode (prefill-sized calls: the bf16 GEMM)
            monkeypatch.setenv("INFERFLOW_NATIVE_Q8X", "0")
            assert _err(lin(x), exact) <= EXACT_TOL
            monkeypatch.delenv("INFERFLOW_NATIVE_Q8X")
        if large:  # the exact float32 large-batch path (vocab heads always; all weights when switched off)
            monkeypatch.setattr(cpu_kernels, "NATIVE_PREFILL_BF16", False)
            assert _err(lin(x), exact) <= EXACT_TOL
    x = torch.randn(2, 3, w.shape[1])
    assert lin(x).shape == (2, 3, w.shape[0])
    assert lin(x[:0]).shape == (0, 3, w.shape[0])  # an empty batch
    lin.bias = None
    assert lin(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("bf16", [True, False])
def test_large_batch_path_in_slabs(monkeypatch, bf16):
    monkeypatch.setattr(cpu_kernels, "NATIVE_DECODE_ELEMS", 96 * 7)  # several row slabs, a partial last one
    monkeypatch.setattr(cpu_kernels, "NATIVE_PREFILL_BF16", bf16)
    lin, w = _linear(Q.Q8_0)
    x = torch.randn(40, w.shape[1])
    assert _err(lin(x), x.double() @ w.double().T + lin.bias.double()) <= (BF16_TOL if bf16 else EXACT_TOL)
    blocks, shape, w = _case(Q.Q6_K)  # the bf16 decode: the exact weights rounded to bf16
    out = torch.empty(shape[0] * shape[1], dtype=torch.bfloat16)
    assert torch.equal(native_linear.dequantize_bf16(blocks, int(Q.Q6_K), shape, out), w.bfloat16())


def test_q4_k_prefers_the_int4_kernel_where_it_applies():
    lin, _ = _linear(Q.Q4_K)  # 40 rows: the int4 kernel refuses (rows not a multiple of 16), native runs
    assert lin.kernels["weight"] == "native"
    blocks = random_blocks(Q.Q4_K, 64, 256, 1)
    big = create("linear", {"in_features": 256, "out_features": 64, "bias": False})
    assert big.load_packed("weight", PackedTensor(blocks, int(Q.Q4_K), (64, 256)), torch.float32)
    assert big.kernels["weight"] == ("int4" if cpu_kernels.int4pack.supports(int(Q.Q4_K), (64, 256)) else "native")


def test_off_and_reference_keep_torch_paths(monkeypatch):
    lin, _ = _linear(Q.Q4_0, "reference")
    assert lin.kernels["weight"] == "reference"
    monkeypatch.setenv("INFERFLOW_NATIVE", "0")
    lin, _ = _linear(Q.Q4_0)
    assert lin.kernels["weight"] != "native"


def _tiny(tmp_path, qtype: Q):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_llama(transformers.LlamaForCausalLM(cfg).eval(), path, qtype)
    return path


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_model_tokens_native_on_and_off(tmp_path, monkeypatch, qtype):
    path = _tiny(tmp_path, qtype)
    nat, ref = inferflow.load(path), inferflow.load(path, quant_kernels="reference")
    kinds = {k for m in nat.net.modules() for k in (getattr(m, "kernels", None) or {}).values()}
    assert kinds == {"native"}, kinds
    seq = [5, 17, 3, 88, 41, 9, 60]
    want_logits = ref.logits(seq).double()
    if native_linear.has_vnni():  # the default: int8 activations (llama.cpp's arithmetic), within its tolerance
        assert 1e-5 < _err(nat.logits(seq), want_logits) <= Q8X_TOL
    monkeypatch.setenv("INFERFLOW_NATIVE_Q8X", "0")  # the exact decode of the blocks
    assert _err(nat.logits(seq), want_logits) <= 1e-5  # exact weights: float32 order only
    # the engine's post-load fusion concatenates native block rows: q/k/v and gate/up become one linear each
    assert fuse_projections(nat.net) == 4
    fused = [m for n, m in nat.net.named_modules() if n.endswith(("qkv_proj", "gate_up_proj"))]
    assert len(fused) == 4 and all(m.kernels["weight"] == "native" and hasattr(m, "weight_blocks") for m in fused)
    assert _err(nat.logits(seq), want_logits) <= 1e-5
    monkeypatch.setenv("INFERFLOW_NATIVE", "0")
    off = inferflow.load(path)
    assert "native" not in {k for m in off.net.modules() for k in (getattr(m, "kernels", None) or {}).values()}
    want = ref.generate_ids(seq, max_new_tokens=8)
    assert nat.generate_ids(seq, max_new_tokens=8) == want
    assert off.generate_ids(seq, max_new_tokens=8) == want
