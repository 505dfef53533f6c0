"""Cross-kernel L2 prefetch (inferflow/quant/l2_prefetch.py): which weight each captured 4-bit matmul prefetches,
the struct the CUDA kernels read, the settings. With INFERFLOW_TEST_DEVICE=cuda (and nvcc), a captured chain of
4-bit matmuls that prefetch gives the eager chain's outputs bit for bit, in both modes."""
import ctypes
import os

import pytest
import torch

from inferflow.native import cuda
from inferflow.quant import formats, ggml, l2_prefetch, triton_kernels, triton_soa

DEVICE = os.environ.get("INFERFLOW_TEST_DEVICE", "cpu")


def weight(n: int, k: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(n, k // 2, dtype=torch.uint8), torch.zeros(n, k // 32, dtype=torch.float16)


def test_struct_matches_the_kernels():
    # inferflow_cuda::Prefetch (native/cuda_common.cuh): two pointers, two 32-bit sizes, an int, 8-byte aligned
    P = l2_prefetch.Prefetch
    assert ctypes.sizeof(P) == 32
    assert [getattr(P, f).offset for f in ("p0", "p1", "n0", "n1", "at_end")] == [0, 8, 16, 20, 24]
    header = (cuda._HERE / "cuda_common.cuh").read_text()
    body = header[header.index("struct Prefetch {"):header.index("};", header.index("struct Prefetch {"))]
    fields = [line.split(";")[0].split()[-1] for line in body.splitlines()[1:] if ";" in line]
    assert fields == ["p0", "p1", "n0", "n1", "at_end"]
    assert l2_prefetch.address(None) is None
    p = P()
    assert l2_prefetch.address(p) == ctypes.addressof(p)


def test_each_call_prefetches_the_next_recorded_weight(monkeypatch):
    monkeypatch.setenv(l2_prefetch.ENV, "start")
    monkeypatch.setenv(l2_prefetch.CAP_ENV, "64")
    ws = [weight(n) for n in (32, 64, 128)]
    assert l2_prefetch.visit(ws[0]) is None  # outside a scope: eager calls never prefetch
    with l2_prefetch.recording() as order:
        for w in ws:
            assert l2_prefetch.visit(w) is None
    assert [o[0].data_ptr() for o in order] == [w[0].data_ptr() for w in ws]
    with l2_prefetch.capturing(order):
        got = [l2_prefetch.visit(w) for w in ws]
    for pf, nxt in zip(got, ws[1:] + ws[:1]):  # the last call: the first weight, for the next step
        assert (pf.p0, pf.p1) == (nxt[0].data_ptr(), nxt[1].data_ptr())
        assert (pf.n0, pf.n1, pf.at_end) == (nxt[0].numel(), nxt[1].numel() * 2, 0)
    monkeypatch.setenv(l2_prefetch.ENV, "end")
    with l2_prefetch.capturing(order):
        assert l2_prefetch.visit(ws[0]).at_end == 1
    monkeypatch.setenv(l2_prefetch.ENV, "0")
    with l2_prefetch.capturing(order):
        assert l2_prefetch.visit(ws[0]) is None


def test_another_order_stops_prefetching(monkeypatch):
    monkeypatch.setenv(l2_prefetch.ENV, "start")
    ws = [weight(n) for n in (32, 64, 128)]
    with l2_prefetch.recording() as order:
        for w in ws:
            l2_prefetch.visit(w)
    with l2_prefetch.capturing(order):
        assert l2_prefetch.visit(ws[0]) is not None
        assert l2_prefetch.visit(ws[2]) is None  # not the recorded second call
        assert l2_prefetch.visit(ws[2]) is None  # and nothing after it, even where it would match again
    with l2_prefetch.capturing(order):  # a new capture starts over
        assert l2_prefetch.visit(ws[0]) is not None
    with l2_prefetch.capturing([tuple(ws[0])]):  # one call: nothing to prefetch
        assert l2_prefetch.visit(ws[0]) is None


def test_capped_to_the_leading_part(monkeypatch):
    codes, scales = weight(4096, 4096)  # 8 MB of codes, 1 MB of scales
    pf = l2_prefetch.describe((codes, scales), False, 3 << 20)
    nc, ns = codes.numel(), scales.numel() * 2
    assert pf.n0 + pf.n1 <= 3 << 20 and pf.n0 % 16 == 0 and pf.n1 % 16 == 0
    assert abs(pf.n0 / nc - pf.n1 / ns) < 1e-3  # the same fraction of each
    assert l2_prefetch.describe((codes, scales), True, 1 << 30).n0 == nc  # under the cap: all of it
    monkeypatch.setenv(l2_prefetch.CAP_ENV, "1.5")
    assert l2_prefetch.cap_bytes() == 3 << 19
    monkeypatch.setenv(l2_prefetch.CAP_ENV, "lots")
    with pytest.raises(ValueError, match=r"\$INFERFLOW_L2_PREFETCH_MB: expected megabytes, got 'lots'"):
        l2_prefetch.cap_bytes()
    monkeypatch.setenv(l2_prefetch.ENV, "always")
    with pytest.raises(ValueError, match=r"\$INFERFLOW_L2_PREFETCH: expected start, end or 0, got 'always'"):
        l2_prefetch.mode()


def test_matmuls_record_their_weights_and_captures_match_eager(monkeypatch, request):
    # the engine's 4-bit matmul records the tensors it reads, in call order (on the CPU: Triton's interpreter on
    # the SoA layout); on CUDA a captured chain that prefetches gives the eager outputs bit for bit, both modes
    if DEVICE == "cpu":  # Triton's interpreter on, before triton is first imported (when this file runs alone)
        request.getfixturevalue("triton_interpreter")
        request.getfixturevalue("one_thread")
    pytest.importorskip("triton")  # the `test` extra installs it
    n, k = 96, 256
    blocks = [formats.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(i)), "q4_0").data
              .reshape(n, -1).to(DEVICE) for i in range(3)]
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)

    def chain() -> list[torch.Tensor]:
        return [triton_kernels.matmul(x, b, ggml.Q4_0, (n, k), None) for b in blocks]

    ref = chain()  # on CUDA: kernels chosen and timed, layouts made
    with l2_prefetch.recording() as order:
        chain()
    read = [{triton_soa.soa(b, "q4_0", (n, k))[0].data_ptr()} for b in blocks]
    if DEVICE == "cuda":  # or the tensor-core layout, where a tensor-core kernel was picked
        from inferflow.quant import cuda_q4_mma

        for r, b in zip(read, blocks):
            r |= {t[0].data_ptr() for t in [triton_soa.cached(b, "q4_0", (n, k), make=cuda_q4_mma.repack)] if t}
    assert len(order) == 3 and all(o[0].data_ptr() in r for o, r in zip(order, read))
    if DEVICE != "cuda":
        return
    if cuda.nvcc() is None:
        pytest.fail("INFERFLOW_TEST_DEVICE=cuda needs nvcc for this test")
    for mode in ("start", "end"):
        monkeypatch.setenv(l2_prefetch.ENV, mode)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), l2_prefetch.capturing(order):
            outs = chain()
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, r) for o, r in zip(outs, ref)), mode
