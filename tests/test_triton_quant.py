"""Triton dequant-fused matmuls (inferflow/quant/triton_kernels.py) run on a CPU under TRITON_INTERPRET=1 against
F.linear with the torch-dequantized weight: the same kernels the GPU runs (tools/bench_triton_quant.py checks them
on CUDA). Bit-identical decoded weights (an identity activation reads them back), float tolerance for products."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are built (lazily, at first use)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")  # the `test` extra installs it

from inferflow.quant import cpu_kernels, formats, triton_kernels  # noqa: E402
from inferflow.registry import create  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread", "triton_interpreter")
NAMES = ("q4", "q8", "q8_0", "q4_0")


def _packed(name: str, n: int = 80, k: int = 96, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    w[:, :32] *= 4  # blocks of different scales
    return formats.quantize(w, name)


@pytest.mark.parametrize("name", NAMES)
def test_decoded_weights_are_bit_identical(name):
    p = _packed(name)
    assert triton_kernels.supports(p.qtype, p.shape, "cpu")
    eye = torch.eye(96)  # 96 rows: the tl.dot GEMM path; IEEE float32 products with exact zeros
    y = triton_kernels.matmul(eye, p.data, p.qtype, p.shape)
    assert torch.equal(y.t(), p.dequantize())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("m", [1, 20])  # GEMV rows (decode) and GEMM rows (prefill)
def test_matmul_matches_torch(name, m):
    p = _packed(name, seed=m)
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(7))
    bias = torch.randn(80, generator=torch.Generator().manual_seed(8))
    ref = F.linear(x, p.dequantize(), bias)
    y = triton_kernels.matmul(x, p.data, p.qtype, p.shape, bias)
    assert y.shape == ref.shape and y.dtype == torch.float32
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    xb = x.bfloat16()  # bf16 activations: the GPU's dtype (output bf16, float32 accumulation)
    yb = triton_kernels.matmul(xb, p.data, p.qtype, p.shape, bias)
    refb = F.linear(xb.float(), p.dequantize(), bias)
    assert yb.dtype == torch.bfloat16 and (yb.float() - refb).abs().max() <= 1e-2 * refb.abs().max()


def test_linear_component_uses_the_kernel_when_supported():
    """Under the interpreter, the fast kernel set holds q4 as "triton" blocks wherever the kernels can run them."""
    p = _packed("q4", n=64, k=64)
    lin = create("linear", {"in_features": 64, "out_features": 64, "bias": False})
    with cpu_kernels.using("fast"), cpu_kernels.prefer_triton(True):
        assert lin.load_packed("weight", p, torch.float32)
    assert lin.kernels["weight"] == "triton"
    x = torch.randn(2, 64)
    ref = F.linear(x, p.dequantize())
    assert (lin(x) - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_a_failing_kernel_falls_back_to_the_reference(monkeypatch):
    p = _packed("q8", n=64, k=64)
    lin = create("linear", {"in_features": 64, "out_features": 64, "bias": False})
    with cpu_kernels.using("fast"), cpu_kernels.prefer_triton(True):
        assert lin.load_packed("weight", p, torch.float32)

    def broken(*a, **k):
        raise RuntimeError("no compiler")
    monkeypatch.setattr(triton_kernels, "matmul", broken)
    monkeypatch.setattr(triton_kernels, "_broken", [])
    x = torch.randn(2, 64)
    with pytest.warns(RuntimeWarning, match="disabled"):
        y = lin(x)
    assert torch.allclose(y, F.linear(x, p.dequantize()), rtol=1e-5, atol=1e-5)
    assert not triton_kernels.enabled() and not triton_kernels.supports(p.qtype, p.shape, "cpu")


def test_autotune_asks_triton_to_keep_its_picks(monkeypatch):
    """The quantized kernels' autotune (triton_q4.autotune) passes cache_results where this Triton's autotune takes
    it, so an engine start does not time their configs again, and leaves it out where it does not. (Under the
    interpreter Triton itself keeps nothing, so the decorator is stubbed here.)"""
    import triton

    from inferflow.quant import triton_q4

    seen = {}

    def new(configs, key, cache_results=False, **kw):
        seen["new"] = cache_results
        return "decorator"

    def old(configs, key, **kw):
        seen["old"] = kw
        return "decorator"

    monkeypatch.setattr(triton, "autotune", new)
    assert triton_q4.autotune(configs=[], key=["N"]) == "decorator" and seen["new"] is True
    monkeypatch.setattr(triton, "autotune", old)
    assert triton_q4.autotune(configs=[], key=["N"]) == "decorator" and "cache_results" not in seen["old"]
