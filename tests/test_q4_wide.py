"""4-bit matmuls of 65-256 rows inside CUDA graphs (inferflow/quant/q4_wide.py): the fused GEMM, decode + cuBLAS,
64-row chunks or (Hopper) the warpgroup-MMA GEMM, chosen by timing in the graph warm-up only, and a captured graph
replays the chosen path correctly."""
import os

import pytest
import torch

from inferflow.quant import formats, q4_wide, triton_kernels, triton_soa

DEVICE = os.environ.get("INFERFLOW_TEST_DEVICE", "cpu")
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs (INFERFLOW_TEST_DEVICE=cuda)")


def _never(*a):
    pytest.fail("timed outside the graph warm-up")


def test_no_choice_off_the_gpu_or_switched_off(monkeypatch):
    monkeypatch.setattr(q4_wide, "_time", _never)
    x = torch.randn(96, 64)
    assert q4_wide.pick(x, 32, 64, "q4_0", None, {q4_wide.FUSED: _never, q4_wide.DECODE: _never}) == q4_wide.FUSED
    monkeypatch.setenv("INFERFLOW_Q4_WIDE", "0")
    assert not q4_wide.enabled()


def test_warpgroup_candidate_offered_without_a_build(monkeypatch):
    # where the warpgroup-MMA GEMM takes the operands (sm_90), it is a candidate; listing it builds nothing (an
    # eager step takes the fused GEMM and must not wait for nvcc), and INFERFLOW_Q4_WGMMA=0 leaves it out
    from inferflow.quant import cuda_q4, cuda_q4_mma

    monkeypatch.setattr(cuda_q4_mma, "wg_supports", lambda x2, kind, k: True)
    monkeypatch.setattr(cuda_q4, "_bias_ok", lambda x2, bias: True)
    monkeypatch.setattr(cuda_q4, "_mma_lib", _never)
    x = torch.randn(100, 64)
    assert list(triton_soa.wide_calls(x, None, None, None, None, "q4_0", (32, 64), None)) == [
        q4_wide.FUSED, q4_wide.DECODE, q4_wide.CHUNKS, q4_wide.WGMMA]
    monkeypatch.setenv("INFERFLOW_Q4_WGMMA", "0")
    assert q4_wide.WGMMA not in triton_soa.wide_calls(x, None, None, None, None, "q4_0", (32, 64), None)


@pytest.fixture
def fresh_choices(monkeypatch, tmp_path):
    from inferflow.native import choices

    monkeypatch.setattr(choices, "cache_dir", lambda: tmp_path / "native")
    monkeypatch.setattr(q4_wide, "STORE", choices.ChoiceStore("q4_wide", []))
    monkeypatch.setattr(q4_wide, "_choice", {})
    return tmp_path


def _weight(n: int, k: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(7))
    p = formats.quantize(w, "q4_0")
    return p, p.data.reshape(n, -1).to(DEVICE)


@cuda_only
@pytest.mark.parametrize("forced", [q4_wide.DECODE, q4_wide.FUSED, q4_wide.CHUNKS, q4_wide.WGMMA])
def test_graph_replays_the_chosen_path(monkeypatch, fresh_choices, forced):
    from inferflow.model import gpu_gemv
    from inferflow.quant import cuda_q4

    n, k, m = 512, 1024, 96
    p, blocks = _weight(n, k)
    ref_w = p.dequantize().to(DEVICE).bfloat16().double()  # decode + cuBLAS rounds the weight to bf16
    x = torch.randn(m, k, device=DEVICE).bfloat16()
    if forced == q4_wide.WGMMA:  # the warpgroup-MMA GEMM itself, not Triton's GEMM should it time faster
        if not cuda_q4.wide_supports(x, "q4_0", None):
            pytest.skip("the warpgroup-MMA GEMM needs nvcc and an sm_90 GPU")
        monkeypatch.setattr(cuda_q4, "_choice", {})
        monkeypatch.setattr(cuda_q4, "_stored", lambda *a: None)
        monkeypatch.setattr(cuda_q4, "_time", lambda *a: ("wg", 0))
    monkeypatch.setattr(q4_wide, "_time", _never)
    triton_kernels.matmul(x, blocks, p.qtype, (n, k), None)  # eager, outside the warm-up: no choice made
    assert q4_wide._choice == {}
    monkeypatch.setattr(q4_wide, "_time", lambda calls: forced)
    with gpu_gemv.selecting():
        warm = triton_kernels.matmul(x, blocks, p.qtype, (n, k), None)
    assert list(q4_wide._choice.values()) == [forced]
    monkeypatch.setattr(q4_wide, "_time", _never)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = triton_kernels.matmul(x, blocks, p.qtype, (n, k), None)
    for seed in (1, 2):
        x.copy_(torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE))
        g.replay()
        ref = x.double() @ ref_w.t()
        assert (out.double() - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
    assert warm.shape == out.shape


def test_the_two_paths_agree(request):
    """Decode + cuBLAS and the fused GEMM round the same decoded weights to the activations' type and sum in
    float32: they differ by the summation order alone (on a CPU, both paths under Triton's interpreter)."""
    if DEVICE == "cpu":
        request.getfixturevalue("triton_interpreter")
        request.getfixturevalue("one_thread")
    pytest.importorskip("triton")
    n, k, m = 64, 512, 80
    p, blocks = _weight(n, k)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    codes, scales = triton_soa.soa(blocks, "q4_0", (n, k))
    tab = triton_kernels._scale_table(x.device)
    interp = DEVICE == "cpu"
    a = triton_soa._decoded(x, codes, scales, tab, "q4_0", (n, k), None, interp).float()
    b = triton_soa._matmul4(x, blocks, codes, scales, tab, "q4_0", (n, k), None, interp).float()
    top = a.abs().max().item()
    ulp = torch.finfo(dtype).eps
    assert ((a - b).abs() <= ulp * torch.maximum(a.abs(), b.abs()) + 1e-5 * top).all()


@cuda_only
def test_timed_choice_is_stored(fresh_choices):
    from inferflow.model import gpu_gemv

    n, k = 4096, 4096
    p, blocks = _weight(n, k)
    x = torch.randn(128, k, device=DEVICE).bfloat16()
    with gpu_gemv.selecting():
        triton_kernels.matmul(x, blocks, p.qtype, (n, k), None)
    assert list(q4_wide._choice.values())[0] in (q4_wide.FUSED, q4_wide.DECODE, q4_wide.CHUNKS, q4_wide.WGMMA)
    assert len(list((fresh_choices / "choices").glob("q4_wide-*.json"))) == 1
