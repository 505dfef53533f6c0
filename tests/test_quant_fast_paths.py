"""CPU fast paths of inferflow's own formats (inferflow/quant/cpu_kernels.py): q4, q3, q2 on torch's int4 kernel,
q6 and q5 as the sum of two int4-kernel parts, q3.5 of three (its levels split), q3.5 in shapes the kernel refuses
decoded into a reused buffer; each against F.linear with the
bit-exact dequantized weight (same weights, same results within float tolerance)."""
import pytest
import torch
import torch.nn.functional as F

from inferflow.quant import cpu_kernels, formats, int4pack
from inferflow.registry import create

pytestmark = pytest.mark.usefixtures("one_thread", "no_native")  # the torch paths: see test_native_quant.py
BF16_TOL = 1.5e-2  # int4 paths: x, scale and zero rounded to bf16 (as tests/test_cpu_kernels.py)
EXPECT = {"q6": "int4", "q5": "int4", "q4": "int4", "q3": "int4", "q2": "int4", "q3.5": "int4", "q8": "int4"}


def held(name: str, rows: int, cols: int, kernels: str):
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows + cols))
    p = formats.quantize(w, name)
    lin = create("linear", {"in_features": cols, "out_features": rows, "bias": True})
    lin.bias = torch.nn.Parameter(torch.randn(rows, generator=torch.Generator().manual_seed(1)), requires_grad=False)
    with cpu_kernels.using(kernels):
        assert lin.load_packed("weight", p, torch.float32)
    return lin, p.dequantize()


@pytest.mark.parametrize("name", list(EXPECT))
def test_fast_path_matches_reference(name):
    if not int4pack.available() and EXPECT[name] == "int4":
        pytest.skip("torch lacks the CPU int4 kernel")
    lin, w = held(name, 208, 256, "fast")
    ref_lin, _ = held(name, 208, 256, "reference")
    assert lin.kernels["weight"] == EXPECT[name] and ref_lin.kernels["weight"] == "reference"
    tol = BF16_TOL if EXPECT[name] == "int4" else 2e-6
    for m in (1, 7, cpu_kernels.INT4_MAX_ROWS + 3):  # decode rows, and the large-batch (dequantized bf16) path
        x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
        exact = F.linear(x, w, lin.bias)
        for y in (lin(x), ref_lin(x)):
            assert y.shape == exact.shape and y.dtype == torch.float32
        err = ((lin(x) - exact).abs().max() / exact.abs().max()).item()
        assert err <= tol, (name, m, err)
        assert ((ref_lin(x) - exact).abs().max() / exact.abs().max()).item() <= 2e-6


def test_buffer_is_reused_across_linears_of_one_shape():
    a, wa = held("q3.5", 40, 128, "fast")  # 40 rows: not a multiple of 16, the int4 kernel refuses
    b, wb = held("q3.5", 40, 128, "fast")
    assert a.kernels["weight"] == b.kernels["weight"] == "buffer"
    x = torch.randn(2, 128).bfloat16()
    ya, yb = a(x), b(x)  # bf16 activations: decoded into the shared bf16 buffer
    assert torch.allclose(ya.float(), F.linear(x.float(), wa.bfloat16().float(), a.bias.float()), rtol=2e-2, atol=2e-2)
    assert torch.allclose(yb.float(), F.linear(x.float(), wb.bfloat16().float(), b.bias.float()), rtol=2e-2, atol=2e-2)
    key = ((40, 128), torch.bfloat16, torch.device("cpu"))
    buf = cpu_kernels._wlocal.bufs[key]
    assert cpu_kernels._decoded(a.weight_blocks, formats.get("q3.5").qtype, (40, 128), torch.bfloat16) is buf
