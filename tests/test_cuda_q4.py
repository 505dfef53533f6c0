"""The CUDA 4-bit kernels' host side (inferflow/native/cuda.py, inferflow/quant/cuda_q4.py, cuda_q4_mma.py): where
they apply, how they are built and cached, the tensor-core layout, and that they stay out of the way where they
cannot run. The kernels themselves run on a GPU: with INFERFLOW_TEST_DEVICE=cuda the matmul test below runs every
launch config of both against the float64 product; on a CPU the same test runs the Triton kernels under the
interpreter. tools/bench_q4_cuda_gpu.py checks them on a GPU at larger shapes."""
import os
import sys
from pathlib import Path

import pytest
import torch

from inferflow import native
from inferflow.native import cuda
from inferflow.quant import cuda_q4, cuda_q4_mma, formats, ggml, triton_kernels, triton_soa

DEVICE = os.environ.get("INFERFLOW_TEST_DEVICE", "cpu")  # as tests/parity.py (which imports more than needed)


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
    assert cuda_q4.choose(x, None, None, None, None, "q4_0", 8, 256, None, lambda: None)[0] == cuda_q4.TRITON
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
    assert supports(torch.empty(3, 512, dtype=torch.bfloat16))              # 3-64 rows: the tensor cores
    assert supports(torch.empty(64, 512, dtype=torch.bfloat16))
    assert not supports(torch.empty(65, 512, dtype=torch.bfloat16))         # more: Triton's tl.dot GEMM
    assert not supports(torch.empty(3, 512, dtype=torch.float32))           # ... and for float32 above 2 rows
    assert not supports(torch.empty(3, 512, dtype=torch.bfloat16), kind="q4c")  # inferflow q4: FMA only
    assert not supports(x, kind="q8_0")                                    # 8-bit: Triton's GEMV
    assert not supports(x, ptr=4098)                                       # not 16-byte aligned
    assert not supports(torch.empty(2, 514, dtype=torch.float32)[:, :512])  # rows 2056 bytes apart
    assert supports(torch.empty(2, 516, dtype=torch.bfloat16)[:, :512])  # the tensor-core GEMV reads 4-byte pairs
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
@pytest.mark.parametrize("m", [1, 2, 37])
def test_matmul(name, m, request):
    if DEVICE == "cpu":  # Triton's interpreter on, before triton is first imported (when this file runs alone)
        request.getfixturevalue("triton_interpreter")
        request.getfixturevalue("one_thread")
    pytest.importorskip("triton")  # the `test` extra installs it
    n, k = 48, 832  # 4 groups of 256 columns, the last one padded: the kernels' bounds checks
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
        kind = "q4c" if name == "q4" else name
        out = torch.empty(m, n, device=DEVICE)
        for cfg in range(len(cuda_q4.CONFIGS) if m <= 2 else 0):  # every launch config, not only the timed pick
            y = cuda_q4.run(("fma", cfg), x, blocks, codes, scales, tab, kind, n, k, bias, out)
            assert (y.double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
        if kind == "q4_0":  # the tensor cores: bf16 activations (the reference takes them as rounded)
            xb, bb = x.bfloat16(), bias.bfloat16()
            refb = xb.double() @ p.dequantize().double().t().to(DEVICE) + bb.double()
            out = torch.empty(m, n, device=DEVICE, dtype=torch.bfloat16)
            cands = [("mma", c) for c in (cuda_q4_mma.gemv_configs(x.device) if m <= cuda_q4_mma.MAX_ROWS else [])]
            cands += [("rows", c) for c in range(len(cuda_q4_mma.ROWS_CONFIGS))]
            cands += [("wg", c) for c in range(len(cuda_q4_mma.WG_CONFIGS)) if cuda_q4_mma.wg_supports(xb, kind, k)]
            # rows 4 bytes past a 16-byte boundary too: the bulk-copy configs' fallback (their copies need 16)
            buf = torch.empty(m * k + 2, dtype=torch.bfloat16, device=DEVICE)
            xm = buf[2:].view(m, k)
            xm.copy_(xb)
            for cand in cands:
                for xin in (xb, xm) if cand[0] == "mma" else (xb,):
                    y = cuda_q4.run(cand, xin, blocks, codes, scales, tab, kind, n, k, bb, out)
                    assert (y.double() - refb).abs().max().item() <= 8e-3 * refb.abs().max().item(), cand


@pytest.mark.skipif(DEVICE != "cuda", reason="runs Hopper's warpgroup MMA (INFERFLOW_TEST_DEVICE=cuda)")
@pytest.mark.parametrize("m", [9, 64, 100, 256])
def test_warpgroup_gemm(m):
    # every launch config of the wgmma GEMM (native/q4_wgmma.cu) against the float64 product with the decoded
    # weight: 200 rows (13 row tiles, the last padded, 4 row groups) by K = 4096, so that blocks split K
    if not (cuda.nvcc() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs nvcc and an sm_90 GPU")
    n, k = 200, 4096
    p = formats.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(m)), "q4_0")
    blocks = p.data.reshape(n, -1).to(DEVICE)
    w = p.dequantize().double().to(DEVICE)
    codes, scales = triton_soa.soa(blocks, "q4_0", (n, k))
    tab = triton_kernels._scale_table(torch.device(DEVICE))
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(m, k, device=DEVICE).to(dtype)
        bias = torch.randn(n, device=DEVICE).to(dtype)
        ref = x.double() @ w.t() + bias.double()
        assert cuda_q4_mma.wg_supports(x, "q4_0", k) and cuda_q4.wide_supports(x, "q4_0", bias)
        out = torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)
        for cfg in range(len(cuda_q4_mma.WG_CONFIGS)):
            for _ in range(2):  # twice: the split counters are left zero for the next call
                y = cuda_q4.run(("wg", cfg), x, blocks, codes, scales, tab, "q4_0", n, k, bias, out)
                err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
                assert err <= 8e-3, (dtype, cfg, err)


def test_warpgroup_gemm_only_on_sm90(monkeypatch):
    # its instructions are sm_90a's: built for that target there, and not loaded (nor offered) anywhere else
    cmd = cuda.build_command("nvcc", Path("q4_wgmma.cu"), (9, 0), "out.so")
    assert "-gencode=arch=compute_90a,code=sm_90a" in cmd
    assert "-gencode=arch=compute_90,code=sm_90" in cuda.build_command("nvcc", Path("q4_mma.cu"), (9, 0), "o.so")
    assert "-gencode=arch=compute_100,code=sm_100" in cuda.build_command("nvcc", Path("q4_wgmma.cu"), (10, 0), "o")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert cuda.load("q4_wgmma", torch.device("cuda", 0)) is None
    def on_gpu(rows):  # the layout of [rows, 512] bf16 activations on a CUDA device
        t = torch.empty(rows, 512, dtype=torch.bfloat16)

        class OnGpu:
            device, dtype, shape, stride = torch.device("cuda", 0), t.dtype, t.shape, t.stride

            def data_ptr(self):
                return 4096
        return OnGpu()
    assert cuda_q4_mma.rows_supports(on_gpu(100), "q4_0", 512, cuda_q4_mma.WG_MAX)
    assert not cuda_q4_mma.wg_supports(on_gpu(100), "q4_0", 512)  # not sm_90
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cuda_q4_mma.wg_supports(on_gpu(100), "q4_0", 512) and cuda_q4_mma.wg_supports(on_gpu(256), "q4_0", 512)
    assert not cuda_q4_mma.wg_supports(on_gpu(100), "q4_0", 544)
    assert not cuda_q4_mma.wg_supports(on_gpu(8), "q4_0", 512)  # up to 8 rows: the GEMVs'
    assert not cuda_q4_mma.wg_supports(on_gpu(257), "q4_0", 512)


def test_wgmma_header_generated():
    # the wgmma wrappers are generated (N / 2 accumulator operands each): the header is what the tool writes
    tool = Path(__file__).resolve().parent.parent / "tools" / "gen_wgmma_ops.py"
    import subprocess
    assert subprocess.run([sys.executable, str(tool), "--check"], capture_output=True).returncode == 0


def test_tensor_core_layout_round_trip():
    # the layout's documented mapping, read back independently: lane l = 4 g + t, word s, nibble 4 h + a is row
    # g + 8 (a & 1), column 16 s + 2 t + h + 8 (a >> 1) of the 16 x 64 tile; scales (g, blk 0), (g, blk 1),
    # (g + 8, blk 0), (g + 8, blk 1)
    n, k = 40, 192  # 3 row tiles, the last one padded; 3 column tiles
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(5))
    p = formats.quantize(w, "q4_0")
    codes, scales = cuda_q4_mma.repack(p.data, "q4_0", (n, k))
    assert codes.shape == (3, 3, 32, 4) and scales.shape == (3, 3, 8, 4)
    got = torch.zeros(48, k, dtype=torch.float64)
    for rt in range(3):
        for kt in range(3):
            for lane in range(32):
                g, t = divmod(lane, 4)
                for s_ in range(4):
                    word = int(codes[rt, kt, lane, s_]) & 0xFFFFFFFF
                    for j in range(8):
                        h, a = divmod(j, 4)
                        row, col = g + 8 * (a & 1), 16 * s_ + 2 * t + h + 8 * (a >> 1)
                        d = float(scales[rt, kt, g, 2 * (a & 1) + (col // 32)])
                        got[rt * 16 + row, kt * 64 + col] = d * (((word >> (4 * j)) & 15) - 8)
    assert torch.equal(got[:n], ggml.dequantize(p.data, ggml.Q4_0, (n, k)).double())
    assert not got[n:].any()  # padding rows: zero codes and scales
    with pytest.raises(ValueError, match="multiple of 64"):
        cuda_q4_mma.repack(formats.quantize(torch.randn(4, 96), "q4_0").data, "q4_0", (4, 96))


def test_layouts_cached_apart():
    # both layouts' makers are named ``repack``: each weight keeps one entry per layout, freed on demand
    p = formats.quantize(torch.randn(16, 256), "q4_0")
    soa = triton_soa.soa(p.data, "q4_0", (16, 256))
    mma = triton_soa.soa(p.data, "q4_0", (16, 256), make=cuda_q4_mma.repack)
    assert soa[0].shape == (16, 32) and mma[0].shape == (1, 4, 32, 4)
    assert triton_soa.soa(p.data, "q4_0", (16, 256), make=cuda_q4_mma.repack) is mma
    triton_soa.forget(p.data, "q4_0", (16, 256), make=cuda_q4_mma.repack)
    assert triton_soa.soa(p.data, "q4_0", (16, 256), make=cuda_q4_mma.repack) is not mma
    assert triton_soa.soa(p.data, "q4_0", (16, 256)) is soa


def test_tensor_core_operands():
    x = torch.empty(8, 512, dtype=torch.bfloat16)
    assert cuda_q4_mma.supports(x, "q4_0", 512) and cuda_q4_mma.supports(x[:1].half(), "q4_0", 512)
    assert not cuda_q4_mma.supports(x.float(), "q4_0", 512)  # float32 activations: the FMA kernel
    assert not cuda_q4_mma.supports(torch.empty(9, 512, dtype=torch.bfloat16), "q4_0", 512)
    assert not cuda_q4_mma.supports(x, "q4c", 512)  # fractional zero points: not exact as 16-bit floats
    assert not cuda_q4_mma.supports(x, "q4_0", 544)
    # the GEMM: up to 64 rows, each starting 16 bytes after the last (its cp.async copies)
    big = torch.empty(64, 512, dtype=torch.bfloat16)
    assert cuda_q4_mma.rows_supports(big, "q4_0", 512) and cuda_q4_mma.rows_supports(big[:3], "q4_0", 512)
    assert not cuda_q4_mma.rows_supports(torch.empty(65, 512, dtype=torch.bfloat16), "q4_0", 512)
    assert not cuda_q4_mma.rows_supports(torch.empty(4, 516, dtype=torch.bfloat16)[:, :512], "q4_0", 512)
    assert not cuda_q4_mma.rows_supports(big.float(), "q4_0", 512)
    assert not cuda_q4_mma.rows_supports(big, "q4c", 512)


def test_bind_and_check(tmp_path):
    # a stand-in library with the entry points' shape (built by the C compiler: the binding is what is tested)
    import ctypes
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    src = tmp_path / "k.c"
    src.write_text('int k(int a) { return a; }\nconst char* k_error(int c) { return c == 7 ? "bad launch" : "?"; }\n'
                   'int k_configs(void) { return 3; }\n')
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "k.so"), str(src)], check=True)
    lib = ctypes.CDLL(str(tmp_path / "k.so"))
    with pytest.raises(RuntimeError, match="k.cu has 3 launch configs, its Python side 4"):
        cuda.bind(lib, "k", [ctypes.c_int], 4)
    assert cuda.bind(lib, "k", [ctypes.c_int], 3) is lib and lib.k(5) == 5
    cuda.check(lib, "k", lib.k(0))  # 0: no error
    with pytest.raises(RuntimeError, match="k launch failed: bad launch"):
        cuda.check(lib, "k", lib.k(7))


def test_kernel_sources_ship_in_the_wheel():
    # every kernel source and header next to native/__init__.py matches the package-data patterns (a missing
    # header only shows on an installed copy, as a failed build)
    import fnmatch
    import tomllib

    repo = Path(__file__).resolve().parent.parent
    root = repo / "inferflow" / "native"
    pyproject = tomllib.loads((repo / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["inferflow.native"]
    sources = [p.name for p in root.iterdir() if p.is_file() and p.suffix in (".c", ".h", ".cu", ".cuh")]
    assert {"q4_gemv.cu", "q4_mma.cu", "q4_mma_rows.cu", "q4_mma.cuh", "cuda_common.cuh", "step.c"} <= set(sources)
    assert [s for s in sources if not any(fnmatch.fnmatch(s, pat) for pat in patterns)] == []


def test_gemm_never_set_up_inside_a_capture(monkeypatch):
    # inside a CUDA-graph capture nothing is made: the GEMM's workspace (its counters' zeros would only be a node
    # of that graph) and a weight's tensor-core layout (the graph would replay the repack); the call then returns
    # None and the matmul runs Triton's kernel instead
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(cuda_q4_mma, "_workspaces", {})
    assert cuda_q4_mma.workspace(torch.device("cpu")) is None
    p = formats.quantize(torch.randn(16, 256), "q4_0")
    x = torch.randn(3, 256).bfloat16()
    codes, scales = triton_soa.soa(p.data, "q4_0", (16, 256))
    assert cuda_q4.run(("rows", 0), x, p.data, codes, scales, None, "q4_0", 16, 256, None, None) is None
    assert triton_soa.cached(p.data, "q4_0", (16, 256), make=cuda_q4_mma.repack) is None  # nothing repacked
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ws, counters = cuda_q4_mma.workspace(torch.device("cpu"))  # eager: made once, counters zero
    assert ws.numel() == cuda_q4_mma.WORKSPACE_FLOATS and not counters.any()
    assert cuda_q4_mma.workspace(torch.device("cpu"))[0] is ws


@pytest.mark.skipif(DEVICE != "cuda", reason="times the CUDA kernels (INFERFLOW_TEST_DEVICE=cuda)")
def test_choice_is_read_back_by_the_next_process(monkeypatch, tmp_path):
    """A timed choice goes to the choice store; a process that finds it there checks it and does not time again."""
    from inferflow.native import choices

    if cuda.nvcc() is None:
        pytest.skip("no nvcc: only Triton runs")
    monkeypatch.setattr(choices, "cache_dir", lambda: tmp_path / "native")
    monkeypatch.setattr(cuda_q4, "STORE", choices.ChoiceStore("cuda_q4", []))
    monkeypatch.setattr(cuda_q4, "_choice", {})
    n, k = 512, 1024
    p = formats.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(5)), "q4_0")
    blocks = p.data.reshape(n, -1).to(DEVICE)
    for m in (1, 16):
        x = torch.randn(m, k, device=DEVICE).bfloat16()
        y1 = triton_kernels.matmul(x, blocks, p.qtype, (n, k), None).clone()
        key = next(key for key in cuda_q4._choice if key[0] == m)
        first = cuda_q4._choice.pop(key)  # as a new process: nothing in memory
        timed = cuda_q4._time
        monkeypatch.setattr(cuda_q4, "_time", lambda *a: pytest.fail("timed again"))
        y2 = triton_kernels.matmul(x, blocks, p.qtype, (n, k), None)
        monkeypatch.setattr(cuda_q4, "_time", timed)
        assert cuda_q4._choice[key] == first
        torch.testing.assert_close(y2, y1, rtol=1e-2, atol=1e-2)
    assert len(list((tmp_path / "choices").glob("cuda_q4-*.json"))) == 1
