"""The CUDA 4-bit GEMV's host side (inferflow/native/cuda.py, inferflow/quant/cuda_q4.py): where it applies, how
it is built and cached, and that it stays out of the way where it cannot run. The kernel itself runs on a GPU:
with INFERFLOW_TEST_DEVICE=cuda the matmul test below runs it against the float64 product (and checks that it was
picked); on a CPU the same test runs the Triton kernels under the interpreter. tools/bench_q4_cuda_gpu.py checks
every launch config on a GPU."""
import os
import sys
from pathlib import Path

DEVICE = os.environ.get("INFERFLOW_TEST_DEVICE", "cpu")  # as tests/parity.py (which imports triton: too early)
if DEVICE == "cpu":  # the Triton kernels on CPU tensors: triton imported under the switch (its own jit helpers,
    os.environ["TRITON_INTERPRET"] = "1"  # tl.cdiv and the like, read it once), as tests/test_triton_quant.py
    try:
        import triton  # noqa: F401
    except ImportError:  # test_matmul skips; the host-side tests need no triton
        pass

import pytest  # noqa: E402
import torch  # noqa: E402

from inferflow import native  # noqa: E402
from inferflow.native import cuda  # noqa: E402
from inferflow.quant import cuda_q4, formats, triton_kernels, triton_soa  # noqa: E402


def test_not_for_cpu_tensors():
    x = torch.randn(1, 256)
    assert not cuda_q4.supports(x, "q4_0", None)
    assert cuda.load("q4_gemv", torch.device("cpu")) is None


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_switched_off(monkeypatch, value):
    monkeypatch.setenv(cuda.ENV, value)
    assert not cuda.enabled()
    x = torch.randn(1, 256)
    # the choice is Triton's without touching a GPU or the compiler
    assert cuda_q4.choose(x, None, None, None, "q4_0", 8, 256, None, lambda: None) == cuda_q4.TRITON
    monkeypatch.setenv(cuda.ENV, "1")
    monkeypatch.setenv(native.ENV, "0")  # native kernels off altogether: CUDA ones too
    assert not cuda.enabled()


def test_operands_it_takes():
    # shapes and dtypes only (no GPU needed): rows, dtype, alignment of the vector loads, bias dtype
    x = torch.empty(2, 512, dtype=torch.bfloat16)

    def supports(t, kind="q4_0", bias=None, ptr=4096):
        class OnGpu:  # t's layout, a CUDA device and a chosen address
            device, dtype, shape = torch.device("cuda"), t.dtype, t.shape
            stride, element_size = t.stride, t.element_size

            def data_ptr(self):
                return ptr
        return cuda_q4.supports(OnGpu(), kind, bias)

    assert supports(x) and supports(x[:1])
    assert supports(torch.empty(1, 512, dtype=torch.float32))
    assert not supports(torch.empty(3, 512, dtype=torch.bfloat16))          # 3 rows: the tl.dot GEMM
    assert not supports(x, kind="q8_0")                                    # 8-bit: Triton's GEMV
    assert not supports(x, ptr=4098)                                       # not 16-byte aligned
    assert not supports(torch.empty(2, 516, dtype=torch.bfloat16)[:, :512])  # rows 1032 bytes apart
    assert not supports(x, bias=torch.empty(8, dtype=torch.float32))       # bias of another dtype
    assert supports(x, bias=torch.empty(8, dtype=torch.bfloat16))


def test_nvcc_lookup(monkeypatch, tmp_path):
    fake = tmp_path / "bin" / "nvcc"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.delenv("NVCC", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert cuda.nvcc() == str(fake)
    monkeypatch.setenv("NVCC", str(fake))
    assert cuda.nvcc() == str(fake)


def test_build_command_targets_the_gpu():
    cmd = cuda.build_command("nvcc", Path("k.cu"), (9, 0), "/tmp/o.so")
    assert "-gencode=arch=compute_90,code=sm_90" in cmd  # Hopper's own machine code, not PTX for the driver
    assert cmd[-1] == "k.cu" and cmd[cmd.index("-o") + 1] == "/tmp/o.so" and "-shared" in cmd


def test_cached_build(monkeypatch, tmp_path):
    monkeypatch.setenv("INFERFLOW_CACHE_DIR", str(tmp_path))
    src = Path(native.__file__).parent / "q4_gemv.cu"
    calls = []

    def command(out):
        calls.append(out)
        return [sys.executable, "-c", "import sys; open(sys.argv[1], 'w').write('built')", out]

    path = native.cached_build(src, command, "ident-a")
    assert path.read_text() == "built" and path.parent == tmp_path / "native" and path.name.startswith("q4_gemv-")
    assert native.cached_build(src, command, "ident-a") == path and len(calls) == 1  # cached: not rebuilt
    assert native.cached_build(src, command, "ident-b") != path  # another compiler or flags: another build
    assert not [p for p in path.parent.iterdir() if not p.name.startswith("q4_gemv-")]  # no temporary left

    def failing(out):
        return [sys.executable, "-c", "import sys; sys.stderr.write('bad kernel'); sys.exit(2)"]

    with pytest.raises(RuntimeError, match=r"q4_gemv\.cu:\n.*bad kernel"):
        native.cached_build(src, failing, "ident-c")


@pytest.mark.parametrize("name", ["q4_0", "q4"])
@pytest.mark.parametrize("m", [1, 2])
def test_matmul(name, m, request):
    pytest.importorskip("triton")  # the `test` extra installs it
    if DEVICE == "cpu":
        request.getfixturevalue("triton_interpreter")
        request.getfixturevalue("one_thread")
    n, k = 48, 800  # 4 groups of 256 columns, the last one padded: the kernel's bounds checks
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3))
    p = formats.quantize(w, name)
    blocks = p.data.reshape(n, -1).to(DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    bias = torch.randn(n).to(DEVICE)
    ref = x.double() @ p.dequantize().double().t().to(DEVICE) + bias.double()
    y = triton_kernels.matmul(x, blocks, p.qtype, (n, k), bias)
    assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    if DEVICE == "cuda" and cuda.nvcc() is not None:
        codes, scales = triton_soa.soa(blocks, "q4c" if name == "q4" else name, (n, k))
        tab = triton_kernels._scale_table(x.device)
        for cfg in range(len(cuda_q4.CONFIGS)):  # every launch config, not only the one the timing picked
            y = cuda_q4.gemv(x, codes, scales, tab, "q4c" if name == "q4" else name, n, k, bias, cfg)
            assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
